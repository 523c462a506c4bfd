/**
 * Lanes: a consumer group on one or more streams per tenant (read in the
 * lane's order), each lane under the tenant's own hash tag, so lanes spread
 * over a Redis Cluster's slots while every atomic step stays inside one. A
 * registry of lanes with work (a set, in its own slot) lets workers find
 * them without scanning the keyspace, and a publish after each enqueue wakes
 * idle workers at once.
 *
 * The registry is kept free of lost updates by ordering, not by locks: the
 * producer adds a lane *after* its enqueue, and a worker that found a lane
 * empty removes it and *then* looks again, re-adding it if work arrived in
 * between. A periodic sweep repairs what a crash between enqueue and add
 * left behind.
 *
 * No crash can hide a lane from that sweep: the enqueue script itself adds
 * the lane to a set no second command is needed for. On one Redis server
 * that is the registry's `all` set (a script may touch any key there); on a
 * Redis Cluster it is the lane's *home*, a set in the lane's own slot (one
 * per slot), which the sweep reads and folds into `all`.
 */
import calculateSlot from "cluster-key-slot";
import type { RedisClient } from "../clients.ts";
import type { Logger } from "../log/logger.ts";
import { ANNOUNCE_LANE_SCRIPT } from "./announce_lane_script.ts";
import { HAS_UNDELIVERED_SCRIPT } from "./has_undelivered_script.ts";
import { laneId, type LaneNames } from "./message.ts";

export { createLaneShares, LANE_SHARE_DEFAULTS, type LaneCharge, type LaneShares } from "./lane_shares.ts";

/** Where a multi-lane worker finds its lanes. */
export interface LaneSource {
  /**
   * News of lanes that may have work: those woken since the last call (a wake-up names its lane), and the next
   * bounded batch of the lanes with work (a walk that starts over as it ends, so every lane with work is named
   * again within a pass). A reader keeps its own set of lanes with work from these, and drops a lane when it
   * finds it drained. What one call costs does not grow with the number of lanes.
   */
  active(): Promise<LaneNames[]>;
  /** A walk over every lane there is, a bounded batch at a time (for reclaim and pruning). */
  walk(): LaneWalk;
  /**
   * A read found every stream of each of `lanes` empty: take them off the lanes with work, unless work arrived
   * meanwhile. @returns those whose work had arrived (they stay among the lanes with work).
   */
  idle(lanes: LaneNames[]): Promise<LaneNames[]>;
  /** Resolves on a wake-up (new work somewhere), or after `ms`. */
  wait(ms: number): Promise<void>;
  /**
   * Calls `listener` with each lane a wake-up names, as it comes (it is still news for `active`): a reader whose
   * slots are all busy learns of a new tenant's work before its next read. Optional: a source without wake-ups.
   */
  onNews?(listener: (lane: LaneNames) => void): void;
}

/** A walk over every lane there is (see {@linkcode LaneSource.walk}). */
export interface LaneWalk {
  /** The next batch of lanes (perhaps none); `done` once the walk has named every lane there was at its start. */
  next(): Promise<{ lanes: LaneNames[]; done: boolean }>;
}

/** Defaults of the registry's walks. */
export const LANE_WALK_DEFAULTS = {
  /** Lanes asked for per batch of a walk (SSCAN's COUNT: a hint, which Redis may exceed on a small set). */
  batch: 256,
} as const;

/** Registry key names. */
export interface LaneRegistryKeys {
  /** Set of lane ids with work. */
  active: string;
  /** Set of every lane id ever used. */
  all: string;
  /** Pub/sub channel a producer publishes a lane id on after enqueuing. */
  wake: string;
  /** On a Redis Cluster: the set of lane ids in the slot of `laneKey` (any key of the lane), its home. */
  home(laneKey: string): string;
  /** Every home there is, one per cluster slot. */
  homes(): string[];
}

const SLOTS = 16_384;
let slotTagTable: string[] | undefined;

/** A hash tag for each of the cluster's slots: `calculateSlot(table[s]) === s` (about 160,000 CRC16s, once). */
function slotTags(): string[] {
  if (slotTagTable) return slotTagTable;
  const table = new Array<string>(SLOTS);
  let filled = 0;
  for (let i = 0; filled < SLOTS; i++) {
    const tag = i.toString(36);
    const slot = calculateSlot(tag);
    if (table[slot] === undefined) {
      table[slot] = tag;
      filled++;
    }
  }
  return (slotTagTable = table);
}

/** The registry's keys under `prefix`, in their own slot. */
export function laneRegistryKeys(prefix: string): LaneRegistryKeys {
  const tag = `${prefix}:{lanes}`;
  const homeKey = (slotTag: string) => `${prefix}:lanes:home:{${slotTag}}`;
  return {
    active: `${tag}:active`,
    all: `${tag}:all`,
    wake: `${prefix}:lanes:wake`,
    home: (laneKey) => homeKey(slotTags()[calculateSlot(laneKey)]!),
    homes: () => slotTags().map(homeKey),
  };
}

/** What an enqueue script is given to make its lane known in the same step (see {@linkcode laneKnownArgs}). */
export interface LaneKnown {
  /** Sets the script adds `lane` to; passed as KEYS, in the lane's slot on a cluster. */
  keys: string[];
  /** The lane id. */
  lane: string;
  /** The channel the script publishes `lane` on; '' for none. */
  wake: string;
  /** Whether the script announces the lane fully, so nothing is left to do after it. */
  announced: boolean;
}

/**
 * What an enqueue script needs to make lane `id` known in the same step as
 * its enqueue (see the module comment); the script adds `lane` to each of
 * `keys` and, unless `wake` is '', publishes it there. On a cluster that is
 * the lane's home (any key of the lane is `laneKey`), with no publish; on one
 * server the registry's `active` and `all` sets and the wake-up, so the
 * script announces the lane fully and nothing is left to do after it. A
 * script may stop after the first of `keys` when that set holds the lane
 * already: on one server, a lane in `active` is in `all` (nothing removes a
 * lane from `all`) and is served (see `intake_script.ts`).
 */
export function laneKnownArgs(redis: RedisClient, keys: LaneRegistryKeys, id: string, laneKey: string): LaneKnown {
  if (redis.isCluster) return { keys: [keys.home(laneKey)], lane: id, wake: "", announced: false };
  return { keys: [keys.active, keys.all], lane: id, wake: keys.wake, announced: true };
}

/**
 * Folds every lane home (Redis Cluster) into the registry's `all` set, so
 * a lane whose announce never ran is known. @returns the lanes added.
 */
export async function foldLaneHomes(redis: RedisClient, keys: LaneRegistryKeys): Promise<string[]> {
  if (!redis.isCluster) return [];
  const found = new Set<string>();
  const homes = keys.homes();
  // In pieces, so one sweep never queues 16,384 commands at once.
  for (let i = 0; i < homes.length; i += 1_024) {
    // One home on a node that is failing over must not stop the sweep: it is read again next time.
    const members = await Promise.all(homes.slice(i, i + 1_024).map((home) => redis.smembers(home).catch(() => [])));
    for (const list of members) for (const id of list) found.add(id);
  }
  // Which of them `all` lacks, asked in bounded pieces (never the whole of `all` in one reply).
  const ids = [...found];
  const missing: string[] = [];
  for (let i = 0; i < ids.length; i += 1_024) {
    const piece = ids.slice(i, i + 1_024);
    const member = await redis.smismember(keys.all, ...piece);
    piece.forEach((id, k) => member[k] === 0 && missing.push(id));
  }
  if (missing.length > 0) await redis.sadd(keys.all, ...missing);
  return missing;
}

/** Whether any of a lane's streams holds messages not yet delivered to its group (one command). */
async function hasUndelivered(redis: RedisClient, lane: LaneNames): Promise<boolean> {
  return await HAS_UNDELIVERED_SCRIPT.run(redis, [...lane.streams], [lane.group]) === 1;
}

/**
 * Tells workers about new work in lane `id`: adds it to the registry and
 * publishes a wake-up. Call it after the enqueue has committed.
 */
export async function announceLane(redis: RedisClient, keys: LaneRegistryKeys, id: string): Promise<void> {
  await ANNOUNCE_LANE_SCRIPT.run(redis, [keys.active, keys.all], [id, keys.wake]);
}

/** Options for {@linkcode createLaneRegistry}. */
export interface LaneRegistryOptions {
  keys: LaneRegistryKeys;
  /** The names of lane `id`. */
  lane(id: string): LaneNames;
  /** How often the sweep re-adds lanes that have work but fell off the active set. */
  sweepMs?: number;
}

/** A walk over a registry set with SSCAN: each batch bounded, whatever the set's size. */
function walkRegistrySet(redis: RedisClient, key: string, toLane: (id: string) => LaneNames): LaneWalk {
  let cursor = "0";
  let started = false;
  return {
    async next() {
      if (started && cursor === "0") return { lanes: [], done: true };
      started = true;
      const [next, found] = await redis.sscan(key, cursor, "COUNT", LANE_WALK_DEFAULTS.batch);
      cursor = next;
      return { lanes: [...new Set(found)].map(toLane), done: cursor === "0" };
    },
  };
}

/** A {@linkcode LaneSource} on the Redis registry; `close` ends its subscription. */
export function createLaneRegistry(
  { redis, log }: { redis: RedisClient; log: Logger },
  options: LaneRegistryOptions,
): LaneSource & { sweep(): Promise<number>; close(): Promise<void> } {
  const { keys } = options;
  const registryIds = new Map<string, string>(); // laneId -> the registry's id of the lane
  const toLane = (id: string) => {
    const lane = options.lane(id);
    registryIds.set(laneId(lane), id);
    return lane;
  };
  let waiters: (() => void)[] = [];
  // Counts wake-ups, so a publish between `active()` and `wait()` is not missed.
  let wakes = 0;
  let wakesSeen = 0;
  const wakeAll = () => {
    wakes++;
    const list = waiters;
    waiters = [];
    for (const w of list) w();
  };
  // Wake-ups come on a connection of their own: a subscribed connection can do nothing else.
  const subscriber = redis.duplicate();
  subscriber.on("error", () => {});
  // The lanes woken since the last `active()`: a wake-up names its lane, or the lanes of an intake call separated
  // by spaces (a set: a busy lane is named once).
  const news = new Set<string>();
  let newsListener: ((lane: LaneNames) => void) | undefined;
  subscriber.on("message", (_channel: string, ids: string) => {
    for (const id of ids.split(" ")) {
      // A lane already news since the last `active()` was told already: a busy lane costs nothing per wake-up.
      if (!id || news.has(id)) continue;
      news.add(id);
      newsListener?.(toLane(id));
    }
    wakeAll();
  });
  const subscribed = subscriber.subscribe(keys.wake).catch((error) => log.warn("lane_wakeup_unavailable", { error }));

  /** On a cluster: lanes in their homes but not in `all` (never announced) join it, and `active` if they have work. */
  async function foldHomes(): Promise<number> {
    const found = await foldLaneHomes(redis, keys);
    if (found.length === 0) return 0;
    log.warn("lanes_found_unannounced", { lanes: found });
    let repaired = 0;
    for (let i = 0; i < found.length; i += LANE_WALK_DEFAULTS.batch) {
      const piece = found.slice(i, i + LANE_WALK_DEFAULTS.batch);
      const withWork = await Promise.all(piece.map((id) => hasUndelivered(redis, toLane(id)).catch(() => false)));
      const ids = piece.filter((_, k) => withWork[k]);
      if (ids.length > 0) repaired += await redis.sadd(keys.active, ...ids);
      for (const id of ids) news.add(id);
    }
    if (repaired) wakeAll();
    return repaired;
  }
  /** Re-adds to `active` every known lane with undelivered messages, a bounded batch at a time. */
  async function repair(): Promise<number> {
    let repaired = 0;
    const all = walkSet(keys.all);
    for (let done = false; !done;) {
      const batch = await all.next();
      done = batch.done;
      const withWork = await Promise.all(batch.lanes.map((lane) => hasUndelivered(redis, lane).catch(() => false)));
      const ids = batch.lanes.filter((_, i) => withWork[i]).map((lane) => registryIds.get(laneId(lane))!);
      if (ids.length > 0) repaired += await redis.sadd(keys.active, ...ids);
    }
    if (repaired) log.info("lanes_repaired", { lanes: repaired });
    return repaired;
  }
  const walkSet = (key: string) => walkRegistrySet(redis, key, toLane);
  const sweep = async () => (await foldHomes()) + (await repair());
  const sweepNow = () => sweep().catch((error) => log.warn("lane_sweep_failed", { error }));
  // Before the first read, the known lanes are walked (a restarted worker finds at once what a crash hid);
  // the homes (16,384 reads on a cluster) are folded in beside the first reads, never in front of them.
  // Then both every `sweepMs`.
  let firstWalk: Promise<unknown> | undefined;
  foldHomes().catch((error) => log.warn("lane_sweep_failed", { error }));
  const sweeper = setInterval(sweepNow, options.sweepMs ?? 30_000);
  Deno.unrefTimer(sweeper);
  // The lanes with work, walked a batch per read: a lane whose wake-up was lost is still found within a pass.
  let activeWalk = walkSet(keys.active);

  return {
    async active() {
      await subscribed;
      await (firstWalk ??= repair().catch((error) => log.warn("lane_sweep_failed", { error })));
      wakesSeen = wakes;
      const woken = [...news];
      news.clear();
      let batch: { lanes: LaneNames[]; done: boolean };
      try {
        batch = await activeWalk.next();
      } catch (error) {
        // The woken lanes are still news: a failed walk must not lose them.
        for (const id of woken) news.add(id);
        throw error;
      }
      if (batch.done) activeWalk = walkSet(keys.active);
      // In order of their ids, as a reader learns them (news of the same lanes named twice, once).
      const named = new Map<string, LaneNames>();
      for (const id of woken) named.set(id, toLane(id));
      for (const lane of batch.lanes) named.set(registryIds.get(laneId(lane))!, lane);
      return [...named.keys()].sort().map((id) => named.get(id)!);
    },
    walk: () => walkSet(keys.all),
    onNews(listener) {
      newsListener = listener;
    },
    async idle(lanes) {
      const known = lanes.filter((lane) => registryIds.has(laneId(lane)));
      if (known.length === 0) return [];
      const ids = known.map((lane) => registryIds.get(laneId(lane))!);
      await redis.srem(keys.active, ...ids);
      // Look again *after* removing: an enqueue that landed meanwhile has either re-added the lane
      // itself (it adds after enqueuing), or is visible here. If the look fails, put the lane back:
      // an extra read of an empty lane costs little, a lost one waits for the sweep.
      const more = await Promise.all(known.map((lane) => hasUndelivered(redis, lane).catch(() => true)));
      const back = ids.filter((_, i) => more[i]);
      if (back.length > 0) await redis.sadd(keys.active, ...back);
      return known.filter((_, i) => more[i]);
    },
    wait(ms) {
      if (wakes !== wakesSeen) return Promise.resolve();
      return new Promise<void>((resolve) => {
        const done = () => {
          clearTimeout(timer);
          resolve();
        };
        const timer = setTimeout(() => {
          waiters = waiters.filter((w) => w !== done);
          resolve();
        }, ms);
        waiters.push(done);
      });
    },
    sweep,
    async close() {
      clearInterval(sweeper);
      wakeAll();
      await subscriber.quit().catch(() => subscriber.disconnect());
    },
  };
}
