/**
 * The queue as people see it: each lane's depth, pending count, lag and
 * oldest entry, the consumers that read it, and its dead letters. The
 * console, `/metrics` and the `dlq` command read Redis stream internals
 * (XPENDING, XINFO, XRANGE) only through this module; the worker's own
 * reads stay in the worker.
 */
import type { RedisClient } from "../clients.ts";
import { type DeadLetter, droppedDeadLetters, pagesOfDeadLetters } from "./dead_letter.ts";
import { type QueueNames } from "./message.ts";
import { fieldsToObject } from "../redis/fields.ts";

/** One lane: its tenant (null for a one-stream queue) and its stream's names. */
export interface InspectedLane<K extends QueueNames = QueueNames> {
  tenant: string | null;
  keys: K;
}

/** What one lane holds right now. */
export interface LaneStats {
  /** Entries in the stream: waiting or delivered and not yet acknowledged. */
  depth: number;
  /** Entries delivered to the group and not yet acknowledged (XPENDING). */
  pending: number;
}

/** A consumer of a lane's group, as XINFO CONSUMERS reports it. */
export interface ConsumerInfo {
  name: string;
  pending: number;
  /** Milliseconds since it last read. */
  idle: number;
}

/** A dead letter and the lane it lies in. */
export type LaneDeadLetter<K extends QueueNames = QueueNames> = DeadLetter & { lane: InspectedLane<K> };

/** How many of a lane's entries are delivered and not yet acknowledged; 0 when the group does not exist yet. */
export async function pendingCount(redis: RedisClient, names: QueueNames): Promise<number> {
  return await redis.xpending(names.stream, names.group).then((s) => Number((s as [number])[0] ?? 0), () => 0);
}

/** A lane's depth and pending count. */
export async function laneStats(redis: RedisClient, names: QueueNames): Promise<LaneStats> {
  const [depth, pending] = await Promise.all([redis.xlen(names.stream), pendingCount(redis, names)]);
  return { depth, pending };
}

/** How long ago the lane's oldest entry was added, in ms; undefined for an empty stream. */
export async function oldestAgeMs(
  redis: RedisClient,
  names: QueueNames,
  nowMs = Date.now(),
): Promise<number | undefined> {
  const [oldest] = await redis.xrange(names.stream, "-", "+", "COUNT", 1);
  return oldest ? nowMs - Number(oldest[0].split("-")[0]) : undefined;
}

/** Entries not yet delivered to the lane's group (XINFO GROUPS `lag`); 0 when the stream or group is missing. */
export async function groupLag(redis: RedisClient, names: QueueNames): Promise<number> {
  const groups = await (redis.call("XINFO", "GROUPS", names.stream) as Promise<unknown[][]>).catch(() => []);
  let lag = 0;
  for (const group of groups) {
    const fields = fieldsToObject(group);
    if (fields.name === names.group) lag = Number(fields.lag ?? 0);
  }
  return lag;
}

/** The consumers of the lane's group (XINFO CONSUMERS); none when the stream or group is missing. */
export async function consumers(redis: RedisClient, names: QueueNames): Promise<ConsumerInfo[]> {
  const replies = await (redis.call("XINFO", "CONSUMERS", names.stream, names.group) as Promise<unknown[][]>)
    .catch(() => []);
  return replies.map((reply) => {
    const fields = fieldsToObject(reply);
    return { name: String(fields.name), pending: Number(fields.pending ?? 0), idle: Number(fields.idle ?? 0) };
  });
}

/** How many dead letters the lane holds. */
export async function deadLetterCount(redis: RedisClient, names: QueueNames): Promise<number> {
  return await redis.xlen(names.dead);
}

/**
 * Every dead letter of `lanes`, lane by lane, oldest first, a page of at most
 * `pageSize` at a time (never a whole stream in memory).
 */
export async function* deadLetterPages<K extends QueueNames>(
  redis: RedisClient,
  lanes: InspectedLane<K>[],
  pageSize?: number,
): AsyncGenerator<LaneDeadLetter<K>[]> {
  for (const lane of lanes) {
    for await (const page of pagesOfDeadLetters(redis, lane.keys, pageSize)) yield page.map((d) => ({ ...d, lane }));
  }
}

/** The lanes whose caps have dropped dead letters, and how many each, ever. */
export async function droppedPerLane<K extends QueueNames>(
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
