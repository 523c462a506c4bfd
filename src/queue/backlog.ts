/**
 * The queue's backlog over every lane, for `/metrics`: how many runs wait (not
 * yet delivered to a worker), how many the lanes hold, and when the oldest
 * waiting one was accepted.
 *
 * A scrape must not walk the lanes: at 10,000 tenants that was 60,000 commands
 * a scrape. So the figures are a **snapshot** in Redis, one small hash that a
 * scrape reads with one `HGET`, whatever the number of lanes. One process at a
 * time (whichever takes the lease, a `SET NX PX` of one interval) walks the
 * lanes with work (the registry's `active` set, by `SSCAN`) every interval, a
 * read-only script per 64 lanes (per lane on a cluster), paced to at most
 * `lanesPerSecond`, and writes the snapshot. Lanes without work are not walked: a lane holds undelivered runs
 * only while it is in `active` (the registry's invariant; a lane a crash left
 * out is found by the sweep, within 30 s). So the walk costs one lane's reads
 * per lane with work per interval, spread over the interval, and nothing for
 * idle tenants; the snapshot is at most one interval plus one walk old, and
 * says so (`takenAtMs`).
 *
 * Every write is safe to run twice: the lease is a `SET NX` (a resend finds it
 * taken and the walk is skipped until the next interval), and the snapshot is
 * written only over an older one (`WRITE_SNAPSHOT_SCRIPT`, by its time).
 */
import type { RedisClient } from "../clients.ts";
import type { Logger } from "../log/logger.ts";
import { sleep } from "../async/timeout.ts";
import { LANE_BACKLOG_SCRIPT } from "./lane_backlog_script.ts";
import { WRITE_SNAPSHOT_SCRIPT } from "./write_snapshot_script.ts";
import type { LaneNames } from "./message.ts";

/** Where the snapshot and its lease live (the service's: `ServiceKeys.backlog`). */
export interface BacklogKeys {
  /** The hash holding the latest snapshot. */
  snapshot: string;
  /** The walker's lease: one walk per interval over all processes. */
  lease: string;
}

/** The backlog over every lane with work, as one walk found it. */
export interface BacklogSnapshot {
  /** When the walk ended, ms since the epoch (the walker's clock). */
  takenAtMs: number;
  /** How long the walk took, ms. */
  walkMs: number;
  /** Lanes walked: the lanes with work. */
  lanes: number;
  /** Runs not yet delivered to a worker. */
  waiting: number;
  /** Runs in the lanes' streams: waiting, or delivered and not yet acknowledged. */
  depth: number;
  /** When the oldest waiting run was accepted, ms since the epoch; undefined when none waits. */
  oldestAcceptedMs?: number;
  /** The deepest lanes by depth, deepest first: `[lane id, depth]` (at most `deepest`). */
  deepest: [string, number][];
  /** Who walked (a process's name), for an operator who wonders. */
  writer: string;
}

/** Defaults of {@linkcode BacklogOptions}. */
export const BACKLOG_DEFAULTS = {
  /** How often a walk starts (over all processes together). */
  intervalMs: 5_000,
  /** Lanes asked of `SSCAN` per batch, and scripts sent at once. */
  batch: 256,
  /** The pace of a walk: 10,000 lanes with work are walked in 2 s. */
  lanesPerSecond: 5_000,
  /** How many of the deepest lanes the snapshot names. */
  deepest: 20,
} as const;

/** Options for {@linkcode measureBacklog} and {@linkcode createBacklogMonitor}. */
export interface BacklogOptions {
  /** The registry's set of lanes with work. */
  active: string;
  keys: BacklogKeys;
  /** The names of lane `id`. */
  lane(id: string): LaneNames;
  intervalMs?: number;
  batch?: number;
  lanesPerSecond?: number;
  deepest?: number;
  /** The clock, ms since the epoch. */
  now?: () => number;
}

/**
 * Walks the lanes with work once, a batch at a time, paced to `lanesPerSecond`: one read-only script per 64
 * lanes (per lane on a cluster).
 * @returns the backlog it found (`writer` empty).
 */
export async function measureBacklog(
  redis: RedisClient,
  options: BacklogOptions,
  signal?: AbortSignal,
): Promise<BacklogSnapshot> {
  const now = options.now ?? Date.now;
  const batch = options.batch ?? BACKLOG_DEFAULTS.batch;
  const pace = options.lanesPerSecond ?? BACKLOG_DEFAULTS.lanesPerSecond;
  const keep = options.deepest ?? BACKLOG_DEFAULTS.deepest;
  const started = performance.now();
  const seen = new Set<string>(); // SSCAN may name a lane twice
  const out: BacklogSnapshot = { takenAtMs: 0, walkMs: 0, lanes: 0, waiting: 0, depth: 0, deepest: [], writer: "" };
  let cursor = "0";
  do {
    const batchStarted = performance.now();
    const [next, found] = await redis.sscan(options.active, cursor, "COUNT", batch);
    cursor = next;
    const ids = found.filter((id) => !seen.has(id) && seen.add(id));
    const replies = await laneBacklogs(redis, ids.map((id) => options.lane(id)));
    replies.forEach(([waiting, depth, oldest], i) => {
      out.lanes++;
      out.waiting += waiting;
      out.depth += depth;
      if (oldest > 0 && (out.oldestAcceptedMs === undefined || oldest < out.oldestAcceptedMs)) {
        out.oldestAcceptedMs = oldest;
      }
      if (depth > 0) keepDeepest(out.deepest, [ids[i]!, depth], keep);
    });
    // Paced: a large walk shares Redis with the service's own commands rather than running ahead of them.
    const due = (ids.length / pace) * 1000 - (performance.now() - batchStarted);
    if (cursor !== "0" && due > 0) await sleep(due, signal);
  } while (cursor !== "0");
  out.takenAtMs = now();
  out.walkMs = Math.round(performance.now() - started);
  return out;
}

/**
 * Lanes one walk's script reads at once on one server: a call per lane was 5,000 calls a second at 20,000 lanes
 * with work, each paid for by the walking process and by Redis beside the lane's own reads (README, issue 39).
 * Bounded so that one call holds Redis about a millisecond at most (the reads take some 12 µs a lane).
 */
const LANES_PER_CALL = 64;

/**
 * What each of `lanes` holds (`LANE_BACKLOG_SCRIPT`), in their order: on one server up to
 * {@linkcode LANES_PER_CALL} lanes a call, on a cluster one (a lane's streams share a slot, lanes do not).
 */
async function laneBacklogs(redis: RedisClient, lanes: LaneNames[]): Promise<[number, number, number][]> {
  const perCall = redis.isCluster ? 1 : LANES_PER_CALL;
  const calls: Promise<number[]>[] = [];
  for (let at = 0; at < lanes.length; at += perCall) {
    const some = lanes.slice(at, at + perCall);
    calls.push(
      LANE_BACKLOG_SCRIPT.run(
        redis,
        some.flatMap((lane) => lane.streams),
        [some[0]!.group, ...some.map((lane) => lane.streams.length)],
      ) as Promise<number[]>,
    );
  }
  const out: [number, number, number][] = [];
  for (const reply of await Promise.all(calls)) {
    for (let i = 0; i < reply.length; i += 3) out.push([reply[i]!, reply[i + 1]!, reply[i + 2]!]);
  }
  // Figures paired with the wrong lanes would name the wrong deepest lanes: a short reply fails the walk instead.
  if (out.length !== lanes.length) {
    throw new Error(`The backlog script answered ${out.length} of ${lanes.length} lanes`);
  }
  return out;
}

/** Inserts `entry` into `list` (deepest first), keeping at most `keep`. */
function keepDeepest(list: [string, number][], entry: [string, number], keep: number): void {
  if (list.length >= keep && entry[1] <= list[list.length - 1]![1]) return;
  let at = list.findIndex(([, depth]) => entry[1] > depth);
  if (at < 0) at = list.length;
  list.splice(at, 0, entry);
  if (list.length > keep) list.pop();
}

/** Reads the latest snapshot: one command. @returns undefined when none was written yet. */
export async function readBacklog(redis: RedisClient, keys: BacklogKeys): Promise<BacklogSnapshot | undefined> {
  const stored = await redis.hget(keys.snapshot, "snapshot");
  return stored === null ? undefined : JSON.parse(stored) as BacklogSnapshot;
}

/** The backlog's walker, shared by every process that exports it; `close` stops it. */
export interface BacklogMonitor {
  /** The latest snapshot (one command). */
  read(): Promise<BacklogSnapshot | undefined>;
  /**
   * One tick: walks and writes a snapshot if this process takes the lease (no other walked in the last
   * interval). @returns whether it walked.
   */
  refresh(): Promise<boolean>;
  close(): Promise<void>;
}

/**
 * Starts the walker: a tick at once, then one every `intervalMs`; each walks only when it takes the lease. With
 * `start: false`, no tick runs but those its owner calls (`refresh`), as tests drive it.
 */
export function createBacklogMonitor(
  { redis, log }: { redis: RedisClient; log: Logger },
  options: BacklogOptions & { writer: string; start?: boolean },
): BacklogMonitor {
  const intervalMs = options.intervalMs ?? BACKLOG_DEFAULTS.intervalMs;
  const stop = new AbortController();
  let lastWalkMs = 0;
  const refresh = async () => {
    // The lease spans an interval, or two walks when a walk takes longer, so walks never overlap.
    const leaseMs = Math.max(intervalMs, 2 * lastWalkMs);
    if (await redis.set(options.keys.lease, options.writer, "PX", leaseMs, "NX") !== "OK") return false;
    const snapshot = await measureBacklog(redis, options, stop.signal);
    lastWalkMs = snapshot.walkMs;
    snapshot.writer = options.writer;
    await WRITE_SNAPSHOT_SCRIPT.run(redis, [options.keys.snapshot], [snapshot.takenAtMs, JSON.stringify(snapshot)]);
    return true;
  };
  const loop = (async () => {
    while (options.start !== false && !stop.signal.aborted) {
      await refresh().catch((error) => {
        if (!stop.signal.aborted) log.warn("backlog_walk_failed", { error });
      });
      await sleep(intervalMs, stop.signal).catch(() => {});
    }
  })();
  return {
    read: () => readBacklog(redis, options.keys),
    refresh,
    async close() {
      stop.abort();
      await loop;
    },
  };
}
