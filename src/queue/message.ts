import type { RedisClient } from "../clients.ts";
/** A stream entry as the worker hands it to a handler. */
export interface StreamMessage {
  id: string;
  fields: Record<string, string>;
  /** How many times the group has delivered it, this delivery included (from the PEL, so it survives crashes). */
  deliveries: number;
}

/** When a stream entry was added (its id's milliseconds). Undefined for a malformed id. */
export function entryTimeMs(id: string): number | undefined {
  const ms = Number(id.split("-")[0]);
  return id !== "" && Number.isFinite(ms) ? ms : undefined;
}

/**
 * When the job of a message was accepted: its `accepted_ms` field when it has one (a message put back in its
 * lane as a new entry keeps its first entry's time there), else its entry id's time.
 */
export function acceptedMsOf({ id, fields }: { id: string; fields: Record<string, string> }): number | undefined {
  const kept = Number(fields.accepted_ms ?? NaN);
  return Number.isFinite(kept) ? kept : entryTimeMs(id);
}

/**
 * Up to `count` entries of `stream` after the id `after` (`-` for the start),
 * oldest first, each as `[id, flat fields]`.
 */
export async function entriesAfter(
  redis: RedisClient,
  stream: string,
  after: string,
  count: number,
): Promise<[string, string[]][]> {
  return await redis.xrange(stream, after === "-" ? "-" : `(${after}`, "+", "COUNT", count);
}

/**
 * Names of one stream of a lane, with the lane's dead-letter stream and consumer group: what each step on one
 * stream takes (a take's record, a reclaim, a heartbeat, an ack, a dead letter, a requeue). All share one hash tag.
 */
export interface QueueNames {
  stream: string;
  dead: string;
  group: string;
}

/**
 * Names of a lane: its streams (one per priority), its one dead-letter stream, and the consumer group each of its
 * streams has. All share one hash tag, so one script may touch every stream of a lane (a Redis Cluster slot). While
 * several streams hold messages, a read shares the lane's takes between them by `shares` (see
 * `take_within_cap_script.ts`), keeping its passes in `priorityState`; without it, it reads them in order. The
 * first stream names the lane (`laneId`).
 */
export interface LaneNames {
  streams: readonly string[];
  dead: string;
  group: string;
  /** The hash of the lane's priority state (each stream's pass), beside its streams. */
  priorityState?: string;
  /** Each stream's share of the lane's takes while several have messages, by index in `streams` (absent: 1). */
  shares?: readonly number[];
}

/** The lane's streams, in read order, each as the names of one stream. */
export function streamsOf(lane: LaneNames): QueueNames[] {
  return lane.streams.map((stream) => ({ stream, dead: lane.dead, group: lane.group }));
}

/** What tells a lane from another inside a worker (its shares, its place in the round): its first stream. */
export function laneId(lane: LaneNames): string {
  return lane.streams[0] ?? "";
}
