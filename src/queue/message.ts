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

/** Names of a consumer group's stream and its dead-letter stream. Both must share one hash tag. */
export interface QueueNames {
  stream: string;
  dead: string;
  group: string;
}
