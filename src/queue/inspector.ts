/**
 * The queue as people see it: each lane's depth, pending count, lag and
 * oldest entry (over all its streams), the consumers that read it, and its
 * dead letters. The
 * console, `/metrics` and the `dlq` command read Redis stream internals
 * (XPENDING, XINFO, XRANGE) only through this module; the worker's own
 * reads stay in the worker.
 */
import type { RedisClient } from "../clients.ts";
import { type DeadLetter, droppedDeadLetters, pagesOfDeadLetters } from "./dead_letter.ts";
import { type LaneNames, type QueueNames, streamsOf } from "./message.ts";
import { fieldsToObject } from "../redis/fields.ts";

/** One lane: its tenant and its names. */
export interface InspectedLane<K extends LaneNames = LaneNames> {
  tenant: string;
  keys: K;
}

/** What one lane holds right now. */
export interface LaneStats {
  /** Entries in the lane's streams: waiting or delivered and not yet acknowledged. */
  depth: number;
  /** Entries delivered to the group and not yet acknowledged (XPENDING), in all the lane's streams. */
  pending: number;
}

/** A consumer of a lane's group, as XINFO CONSUMERS reports it (summed over the lane's streams). */
export interface ConsumerInfo {
  name: string;
  pending: number;
  /** Milliseconds since it last read. */
  idle: number;
}

/** A dead letter and the lane it lies in. */
export type LaneDeadLetter<K extends LaneNames = LaneNames> = DeadLetter & { lane: InspectedLane<K> };

/** How many of a stream's entries are delivered and not yet acknowledged; 0 when the group does not exist yet. */
export async function pendingCount(redis: RedisClient, names: QueueNames): Promise<number> {
  return await redis.xpending(names.stream, names.group).then((s) => Number((s as [number])[0] ?? 0), () => 0);
}

/** Adds up `read` over the lane's streams. */
async function sumOver(lane: LaneNames, read: (stream: QueueNames) => Promise<number>): Promise<number> {
  return (await Promise.all(streamsOf(lane).map(read))).reduce((n, x) => n + x, 0);
}

/** A lane's depth and pending count. */
export async function laneStats(redis: RedisClient, lane: LaneNames): Promise<LaneStats> {
  const [depth, pending] = await Promise.all([
    sumOver(lane, (s) => redis.xlen(s.stream)),
    sumOver(lane, (s) => pendingCount(redis, s)),
  ]);
  return { depth, pending };
}

/** How long ago the lane's oldest entry was added, in ms; undefined when every stream of it is empty. */
export async function oldestAgeMs(
  redis: RedisClient,
  lane: LaneNames,
  nowMs = Date.now(),
): Promise<number | undefined> {
  const firsts = await Promise.all(lane.streams.map((stream) => redis.xrange(stream, "-", "+", "COUNT", 1)));
  const times = firsts.flatMap(([oldest]) => oldest ? [Number(oldest[0].split("-")[0])] : []);
  return times.length > 0 ? nowMs - Math.min(...times) : undefined;
}

/** Entries not yet delivered to the lane's group (XINFO GROUPS `lag`); 0 for a stream or group that is missing. */
export async function groupLag(redis: RedisClient, lane: LaneNames): Promise<number> {
  return await sumOver(lane, async (names) => {
    const groups = await (redis.call("XINFO", "GROUPS", names.stream) as Promise<unknown[][]>).catch(() => []);
    let lag = 0;
    for (const group of groups) {
      const fields = fieldsToObject(group);
      if (fields.name === names.group) lag = Number(fields.lag ?? 0);
    }
    return lag;
  });
}

/**
 * The consumers of the lane's group (XINFO CONSUMERS of each stream; a consumer of several is one, its pending
 * entries summed, its least idle time); none when the streams or the group are missing.
 */
export async function consumers(redis: RedisClient, lane: LaneNames): Promise<ConsumerInfo[]> {
  const byName = new Map<string, ConsumerInfo>();
  for (const stream of lane.streams) {
    const replies = await (redis.call("XINFO", "CONSUMERS", stream, lane.group) as Promise<unknown[][]>)
      .catch(() => []);
    for (const reply of replies) {
      const fields = fieldsToObject(reply);
      const name = String(fields.name);
      const known = byName.get(name);
      const pending = Number(fields.pending ?? 0), idle = Number(fields.idle ?? 0);
      byName.set(
        name,
        known ? { name, pending: known.pending + pending, idle: Math.min(known.idle, idle) } : { name, pending, idle },
      );
    }
  }
  return [...byName.values()];
}

/** How many dead letters the lane holds. */
export async function deadLetterCount(redis: RedisClient, lane: Pick<LaneNames, "dead">): Promise<number> {
  return await redis.xlen(lane.dead);
}

/**
 * Every dead letter of `lanes`, lane by lane, oldest first, a page of at most
 * `pageSize` at a time (never a whole stream in memory).
 */
export async function* deadLetterPages<K extends LaneNames>(
  redis: RedisClient,
  lanes: InspectedLane<K>[],
  pageSize?: number,
): AsyncGenerator<LaneDeadLetter<K>[]> {
  for (const lane of lanes) {
    for await (const page of pagesOfDeadLetters(redis, lane.keys, pageSize)) yield page.map((d) => ({ ...d, lane }));
  }
}

/** The lanes whose caps have dropped dead letters, and how many each, ever. */
export async function droppedPerLane<K extends LaneNames>(
  redis: RedisClient,
  lanes: InspectedLane<K>[],
): Promise<{ lane: InspectedLane<K>; n: number }[]> {
  const dropped = await Promise.all(
    lanes.map(async (lane) => ({ lane, n: await droppedDeadLetters(redis, lane.keys) })),
  );
  return dropped.filter((d) => d.n > 0);
}

/** A consumer summed over every lane it reads: how many lanes, its pending entries, its least idle time. */
export interface WorkerInfo {
  name: string;
  lanes: number;
  pending: number;
  idle: number;
}

/** The consumers of every lane in `lanes`, each summed over its lanes, by name. */
export async function workers(redis: RedisClient, lanes: InspectedLane[]): Promise<WorkerInfo[]> {
  const byName = new Map<string, WorkerInfo>();
  for (const lane of lanes) {
    for (const c of await consumers(redis, lane.keys)) {
      const entry = byName.get(c.name) ?? { name: c.name, lanes: 0, pending: 0, idle: Infinity };
      entry.lanes++;
      entry.pending += c.pending;
      entry.idle = Math.min(entry.idle, c.idle);
      byName.set(c.name, entry);
    }
  }
  return [...byName.values()].sort((a, b) => a.name.localeCompare(b.name));
}
