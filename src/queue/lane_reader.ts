/**
 * The reader: takes new messages from the lanes with work into a worker's
 * free slots, sharing them fairly by weighted cost (see
 * `lane_shares.ts`), each lane within its in-flight cap, and each lane's
 * streams by priority (see `take_within_cap_script.ts`).
 */
import type { RedisClient } from "../clients.ts";
import { TAKE_WITHIN_CAP_SCRIPT } from "./take_within_cap_script.ts";
import type { GroupCache } from "./consumer_group.ts";
import type { LaneShares } from "./lane_shares.ts";
import type { LaneSource } from "./lanes.ts";
import { laneId, type LaneNames, type QueueNames, type StreamMessage } from "./message.ts";
import { fieldsToObject } from "../redis/fields.ts";

/** Defaults of {@linkcode createLaneReader}. */
export const READER_DEFAULTS = {
  /** The longest wait for a wake-up while a capped lane has work: it frees up as its jobs finish. */
  cappedWaitMs: 50,
  /**
   * How long a take's record is kept, for a resend of that take (see `take_within_cap_script.ts`): the default claim idle
   * time, after which the messages it delivered may be another consumer's anyway.
   */
  takeRecordMs: 120_000,
} as const;

type RawEntry = [id: string, fields: string[] | null];

/** The record of `consumer`'s last take from the lane whose first stream is `stream`, in the lane's slot. */
export function takeRecordKey(stream: string, consumer: string): string {
  return `${stream}:taken:${consumer}`;
}

/** Options for {@linkcode createLaneReader}. */
export interface LaneReaderOptions {
  consumer: string;
  lanes: LaneSource;
  groups: GroupCache;
  shares: LaneShares;
  /** The most messages of one lane pending across all consumers (0 or none: no cap). */
  laneMaxInFlight?: number;
  /** Lanes not to read for now (a tenant whose budget is spent); asked on every read. */
  skip?: (lane: LaneNames) => boolean;
  /** Each lane's weight; asked once per read. Default: every lane weighs 1. */
  weights?: () => Promise<(lane: LaneNames) => number>;
}

/** The reader of one worker. */
export interface LaneReader {
  /**
   * Reads up to `free` new messages, passing each to `start` with its lane and the stream it came from; with
   * none to take, waits up to `block` ms for a wake-up. `lanes`: the news of lanes with work being learned,
   * when the caller asked for them already (see `lanes()`).
   * @returns how many were started.
   */
  read(
    free: number,
    block: number,
    start: (lane: LaneNames, stream: QueueNames, message: StreamMessage) => void,
    lanes?: Promise<void>,
  ): Promise<number>;
  /**
   * Asks the source for news of lanes with work and learns them, for a `read` that follows: a caller may ask
   * beside another round trip. What it learns is kept even when no read follows.
   */
  lanes(): Promise<void>;
}

/** One take's answer: the entries of each of the lane's streams, in the lane's order. */
interface Taken {
  perStream: RawEntry[][];
  capped: boolean;
  drained: boolean;
}

/**
 * Takes up to `count` messages from one lane for `consumer`, its streams by their shares (see
 * `take_within_cap_script.ts`), within its in-flight cap.
 * @returns the entries of each stream, whether the cap stopped the take, and whether it drained the lane.
 */
async function takeFrom(
  redis: RedisClient,
  consumer: string,
  laneMaxInFlight: number | undefined,
  lane: LaneNames,
  count: number,
): Promise<Taken> {
  // No `groups.ready`: the script makes a missing group itself.
  // The take's id is made before it is sent: a resend of it carries the same one.
  const prioritised = lane.priorityState !== undefined && lane.streams.length > 1;
  const [state, ...perStream] = await TAKE_WITHIN_CAP_SCRIPT.run(
    redis,
    [takeRecordKey(laneId(lane), consumer), ...lane.streams, ...(prioritised ? [lane.priorityState!] : [])],
    [
      lane.group,
      consumer,
      count,
      laneMaxInFlight ?? 0,
      crypto.randomUUID(),
      READER_DEFAULTS.takeRecordMs,
      ...(prioritised ? [lane.streams.length, ...lane.streams.map((_, i) => lane.shares?.[i] ?? 1)] : []),
    ],
  ) as [number, ...RawEntry[][]];
  return { perStream, capped: state === 1, drained: state === 2 };
}

/** Starts what a take gave, each message with its stream. @returns how many. */
function startTaken(lane: LaneNames, taken: Taken, start: (l: LaneNames, s: QueueNames, m: StreamMessage) => void) {
  let took = 0;
  lane.streams.forEach((stream, k) => {
    const names = { stream, dead: lane.dead, group: lane.group };
    for (const [id, flat] of taken.perStream[k] ?? []) {
      if (flat === null) continue;
      // A new message has been delivered exactly once.
      start(lane, names, { id, fields: fieldsToObject(flat), deliveries: 1 });
      took++;
    }
  });
  return took;
}

/** Creates the reader of one worker. */
export function createLaneReader({ redis }: { redis: RedisClient }, options: LaneReaderOptions): LaneReader {
  const { consumer, groups, shares, lanes: source } = options;
  // The lanes with work as this reader knows them (by laneId): learned from the source's news, forgotten when a
  // take finds them drained. Their order of service is the shares' heap, so no read walks them all.
  const known = new Map<string, LaneNames>();
  // Lanes with work not to read for now (`skip`: a tenant whose budget is spent), looked at again on every read.
  const skipped = new Map<string, LaneNames>();
  let weightOf: (lane: LaneNames) => number = () => 1;
  // Whether the last read started nothing: the next is a wake-up's (or a poll's), see `read`.
  let wasIdle = true;

  const take = (lane: LaneNames, count: number) => takeFrom(redis, consumer, options.laneMaxInFlight, lane, count);

  /** `lane` (has work) joins the lanes served, unless skipped; a lane served already has its weight renewed. */
  function serve(lane: LaneNames) {
    const id = laneId(lane);
    known.set(id, lane);
    if (!skipped.has(id)) shares.activate(id, weightOf(lane));
  }

  /** Asks the source for news of lanes with work, and learns them. */
  const refresh = () => source.active().then((news) => news.forEach(serve));
  // A wake-up is learned as it comes, not only at the next read: a message read ahead then knows whether a lane is
  // due before it (see `LaneShares.behind`).
  source.onNews?.(serve);

  /**
   * Lanes skipped that may be read again rejoin the lanes served, at the clock: a tenant whose budget was spent
   * banked no credit meanwhile. Costs a look per lane skipped, not per lane known.
   */
  function unskip() {
    for (const [id, lane] of skipped) {
      if (options.skip?.(lane)) continue;
      skipped.delete(id);
      if (known.has(id)) shares.activate(id, weightOf(lane));
    }
  }

  /** `lanes` have nothing undelivered: they leave the lanes served and the source's lanes with work, unless work came. */
  async function drained(lanes: LaneNames[]) {
    if (lanes.length === 0) return;
    for (const lane of lanes) {
      shares.drained(laneId(lane));
      known.delete(laneId(lane));
    }
    for (const lane of await source.idle(lanes)) serve(lane);
  }

  /**
   * Shares `free` slots between the lanes with work by weighted cost: each round asks the lanes furthest behind
   * (see `LaneShares.plan`) at once, one take each, so one tenant's backlog never stalls another's jobs, a tenant of
   * large documents does not take the provider's tokens from one of small ones, and a read over 20,000 lanes of one
   * job each waits for a round trip per round, not one per lane.
   */
  async function read(
    free: number,
    block: number,
    start: (lane: LaneNames, stream: QueueNames, m: StreamMessage) => void,
    ahead?: Promise<void>,
  ) {
    if (options.weights) weightOf = await options.weights();
    // Woken from idle with two slots or more free, the lane furthest behind that is known already (a wake-up names
    // its lane as it comes) gives one message beside the walk for news, and the lanes the walk names share the
    // other slots: the first job after a wake-up waits one round trip, not two. Otherwise the walk comes first.
    const learning = ahead ?? refresh();
    let learned = !(wasIdle && free >= 2);
    if (learned) await learning;
    else learning.catch(() => {}); // observed by `learn`
    unskip();
    // What became of the walk beside the first take: a failure is thrown if the read started nothing.
    let walk: { error: unknown } | undefined;
    const learn = async () => {
      learned = true;
      await learning.catch((error) => walk = { error });
      unskip();
    };
    let started = 0;
    let capped = false;
    // Lanes not asked again in this read (capped, or gave fewer than asked): put back at its end.
    const aside: string[] = [];
    // The lanes of the plan being taken from, until each is handled: put back should the read fail meanwhile.
    let planned: string[] = [];
    const usable = (id: string) => {
      const lane = known.get(id);
      if (!lane) return false;
      if (!options.skip?.(lane)) return true;
      // Out of the lanes served until it may be read again (see `unskip`).
      shares.drained(id);
      skipped.set(id, lane);
      return false;
    };
    try {
      // Keep asking until the free slots are used or every lane has said it has no more: an empty or capped lane
      // never leaves a slot idle while another lane has work.
      while (free > 0) {
        const plan = shares.plan(learned ? free : 1, usable);
        if (plan.length === 0) {
          if (learned) break;
          await learn();
          continue;
        }
        planned = plan.map(({ lane }) => lane);
        const results = await Promise.all(plan.map(async ({ lane: id }, i) => {
          const lane = known.get(id)!;
          try {
            return await take(lane, plan[i]!.count);
          } catch (error) {
            // One lane's trouble (its node failing over, a lost group) must not stall the others.
            groups.failed(lane, error);
            return undefined;
          }
        }));
        const took = plan.map(({ lane: id }, i) => results[i] ? startTaken(known.get(id)!, results[i], start) : 0);
        // The walk's lanes are learned before those the take drained are dropped: a lane it drained stays drained.
        if (!learned) await learn();
        const emptied: LaneNames[] = [];
        plan.forEach(({ lane: id, count }, i) => {
          const lane = known.get(id)!;
          const taken = results[i];
          capped ||= taken?.capped ?? false;
          free -= took[i]!;
          started += took[i]!;
          if (taken?.drained) emptied.push(lane);
          // A lane that gave fewer than asked is capped (or failed) for now: not asked again in this read.
          else if (took[i]! < count) aside.push(id);
          else shares.putBack(id);
        });
        planned = [];
        await drained(emptied);
      }
    } finally {
      for (const id of planned) shares.putBack(id);
      for (const id of aside) shares.putBack(id, true);
      // Also when the read throws after starting jobs: the next read is then a busy worker's, which walks first.
      wasIdle = started === 0;
    }
    if (walk && started === 0) throw walk.error;
    // Nothing to take: wait for a wake-up; a capped lane frees up as its jobs finish, so look again soon.
    if (started === 0 && block > 0) await source.wait(capped ? Math.min(block, READER_DEFAULTS.cappedWaitMs) : block);
    return started;
  }

  return { read, lanes: refresh };
}
