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
import { pendingCount } from "./inspector.ts";
import { laneId, type LaneNames, streamsOf } from "./message.ts";

export { createLaneShares, LANE_SHARE_DEFAULTS, type LaneCharge, type LaneShares } from "./lane_shares.ts";

/** Where a multi-lane worker finds its lanes. */
export interface LaneSource {
  /** Lanes that may have work now. */
  active(): Promise<LaneNames[]>;
  /** Every lane there is (for reclaim, heartbeats and pruning). */
  all(): Promise<LaneNames[]>;
  /** A read found every stream of `lane` empty: take it off the active set, unless work arrived meanwhile. */
  idle(lane: LaneNames): Promise<void>;
  /** Resolves on a wake-up (new work somewhere), or after `ms`. */
  wait(ms: number): Promise<void>;
}

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
 * server the registry's `all` and `active` sets and the wake-up, so the
 * script announces the lane fully and nothing is left to do after it.
 */
export function laneKnownArgs(redis: RedisClient, keys: LaneRegistryKeys, id: string, laneKey: string): LaneKnown {
  if (redis.isCluster) return { keys: [keys.home(laneKey)], lane: id, wake: "", announced: false };
  return { keys: [keys.all, keys.active], lane: id, wake: keys.wake, announced: true };
}

/**
 * Folds every lane home (Redis Cluster) into the registry's `all` set, so
 * a lane whose announce never ran is known. @returns the lanes added.
 */
export async function foldLaneHomes(redis: RedisClient, keys: LaneRegistryKeys): Promise<string[]> {
  if (!redis.isCluster) return [];
  const known = new Set(await redis.smembers(keys.all));
  const found = new Set<string>();
  const homes = keys.homes();
  // In pieces, so one sweep never queues 16,384 commands at once.
  for (let i = 0; i < homes.length; i += 1_024) {
    // One home on a node that is failing over must not stop the sweep: it is read again next time.
    const members = await Promise.all(homes.slice(i, i + 1_024).map((home) => redis.smembers(home).catch(() => [])));
    for (const list of members) for (const id of list) if (!known.has(id)) found.add(id);
  }
  if (found.size > 0) await redis.sadd(keys.all, ...found);
  return [...found];
}

/** Whether any of a lane's streams holds messages not yet delivered to its group. */
async function hasUndelivered(redis: RedisClient, lane: LaneNames): Promise<boolean> {
  const found = await Promise.all(
    streamsOf(lane).map(async (stream) => {
      const [length, pending] = await Promise.all([redis.xlen(stream.stream), pendingCount(redis, stream)]);
      // Acked entries are deleted (XDEL), so everything beyond the pending ones is undelivered.
      return length > pending;
    }),
  );
  return found.includes(true);
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

/** A {@linkcode LaneSource} on the Redis registry; `close` ends its subscription. */
export function createLaneRegistry(
  { redis, log }: { redis: RedisClient; log: Logger },
  options: LaneRegistryOptions,
): LaneSource & { sweep(): Promise<number>; close(): Promise<void> } {
  const { keys } = options;
  const ids = new Map<string, string>(); // laneId -> the registry's id of the lane
  const toLane = (id: string) => {
    const lane = options.lane(id);
    ids.set(laneId(lane), id);
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
  subscriber.on("message", wakeAll);
  const subscribed = subscriber.subscribe(keys.wake).catch((error) => log.warn("lane_wakeup_unavailable", { error }));

  /** On a cluster: lanes in their homes but not in `all` (never announced) join it, and `active` if they have work. */
  async function foldHomes(): Promise<number> {
    const found = await foldLaneHomes(redis, keys);
    if (found.length === 0) return 0;
    log.warn("lanes_found_unannounced", { lanes: found });
    let repaired = 0;
    for (const id of found) {
      if (await hasUndelivered(redis, toLane(id)) && (await redis.sadd(keys.active, id)) === 1) repaired++;
    }
    if (repaired) wakeAll();
    return repaired;
  }
  /** Re-adds to `active` every known lane with undelivered messages. */
  async function walk(): Promise<number> {
    let repaired = 0;
    for (const id of await redis.smembers(keys.all)) {
      const lane = toLane(id);
      if (await hasUndelivered(redis, lane) && (await redis.sadd(keys.active, id)) === 1) repaired++;
    }
    if (repaired) log.info("lanes_repaired", { lanes: repaired });
    return repaired;
  }
  const sweep = async () => (await foldHomes()) + (await walk());
  const sweepNow = () => sweep().catch((error) => log.warn("lane_sweep_failed", { error }));
  // Before the first read, the known lanes are walked (a restarted worker finds at once what a crash hid);
  // the homes (16,384 reads on a cluster) are folded in beside the first reads, never in front of them.
  // Then both every `sweepMs`.
  let firstWalk: Promise<unknown> | undefined;
  foldHomes().catch((error) => log.warn("lane_sweep_failed", { error }));
  const sweeper = setInterval(sweepNow, options.sweepMs ?? 30_000);
  Deno.unrefTimer(sweeper);

  return {
    async active() {
      await subscribed;
      await (firstWalk ??= walk().catch((error) => log.warn("lane_sweep_failed", { error })));
      wakesSeen = wakes;
      return (await redis.smembers(keys.active)).sort().map(toLane);
    },
    async all() {
      return (await redis.smembers(keys.all)).sort().map(toLane);
    },
    async idle(lane) {
      const id = ids.get(laneId(lane));
      if (id === undefined) return;
      await redis.srem(keys.active, id);
      // Look again *after* removing: an enqueue that landed meanwhile has either re-added the lane
      // itself (it adds after enqueuing), or is visible here. If the look fails, put the lane back:
      // an extra read of an empty lane costs little, a lost one waits for the sweep.
      const more = await hasUndelivered(redis, lane).catch(() => true);
      if (more) await redis.sadd(keys.active, id);
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
