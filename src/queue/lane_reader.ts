/**
 * The reader: takes new messages from the lanes with work into a worker's
 * free slots, sharing them fairly by weighted cost (see
 * `lane_shares.ts`), each lane within its in-flight cap, and each lane's
 * streams in the lane's order.
 */
import type { RedisClient } from "../clients.ts";
import { TAKE_WITHIN_CAP_SCRIPT } from "./take_within_cap_script.ts";
import type { GroupCache } from "./consumer_group.ts";
import type { LaneShares } from "./lane_shares.ts";
import type { LaneSource } from "./lanes.ts";
import { laneId, type LaneNames, type QueueNames, type StreamMessage, streamsOf } from "./message.ts";
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
   * none to take, waits up to `block` ms for a wake-up. `lanes`: the lanes with work, when the caller looked
   * them up already (see `lanes()`).
   * @returns how many were started.
   */
  read(
    free: number,
    block: number,
    start: (lane: LaneNames, stream: QueueNames, message: StreamMessage) => void,
    lanes?: Promise<LaneNames[]>,
  ): Promise<number>;
  /** The lanes with work now, for a `read` that follows: a caller may look them up beside another round trip. */
  lanes(): Promise<LaneNames[]>;
}

/** Creates the reader of one worker. */
export function createLaneReader({ redis }: { redis: RedisClient }, options: LaneReaderOptions): LaneReader {
  const { consumer, groups, shares, lanes: source } = options;
  let lastServed = "";

  /**
   * Takes from one lane, its streams in the lane's order, within its in-flight cap.
   * @returns the messages with the stream each came from, and whether the cap stopped the take.
   */
  async function take(
    lane: LaneNames,
    count: number,
  ): Promise<{ messages: { stream: QueueNames; message: StreamMessage }[]; capped: boolean }> {
    await groups.ready(lane);
    const streams = streamsOf(lane);
    // The take's id is made before it is sent: a resend of it carries the same one.
    const [capped, ...perStream] = await TAKE_WITHIN_CAP_SCRIPT.run(
      redis,
      [takeRecordKey(laneId(lane), consumer), ...lane.streams],
      [lane.group, consumer, count, options.laneMaxInFlight ?? 0, crypto.randomUUID(), READER_DEFAULTS.takeRecordMs],
    ) as [number, ...RawEntry[][]];
    const messages = streams.flatMap((stream, i) =>
      (perStream[i] ?? []).filter((e): e is [string, string[]] => e[1] !== null)
        // A new message has been delivered exactly once.
        .map(([id, flat]) => ({ stream, message: { id, fields: fieldsToObject(flat), deliveries: 1 } }))
    );
    return { messages, capped: capped === 1 };
  }

  /**
   * Shares `free` slots between the lanes with work by weighted cost: each take goes to the lane furthest
   * behind, ties in turn starting one lane further on every call, so one tenant's backlog never stalls another's
   * jobs, and a tenant of large documents does not take the provider's tokens from one of small ones.
   */
  async function read(
    free: number,
    block: number,
    start: (lane: LaneNames, stream: QueueNames, m: StreamMessage) => void,
    ahead?: Promise<LaneNames[]>,
  ) {
    const active = await (ahead ?? source.active());
    const lanes = options.skip ? active.filter((lane) => !options.skip!(lane)) : active;
    let started = 0;
    let capped = false;
    if (lanes.length > 0) {
      const weightOf = options.weights ? await options.weights() : () => 1;
      shares.begin(lanes.map((lane) => ({ id: laneId(lane), weight: weightOf(lane) })));
      // Round-robin order from one lane after the one served first last time. Keep asking until the free
      // slots are used or every lane has said it has no more: an empty or capped lane never leaves a slot
      // idle while another lane has work.
      const at = lanes.findIndex((l) => laneId(l) > lastServed);
      const first = at < 0 ? 0 : at;
      let candidates = [...lanes.slice(first), ...lanes.slice(0, first)];
      for (let asked = 0; free > 0 && candidates.length > 0; asked++) {
        const pick = shares.next(candidates.map(laneId), free);
        const lane = candidates.find((l) => laneId(l) === pick.lane)!;
        if (asked === 0) lastServed = laneId(lane);
        let took = 0;
        try {
          const taken = await take(lane, pick.count);
          capped ||= taken.capped;
          if (taken.messages.length === 0 && !taken.capped) {
            shares.drained(laneId(lane));
            await source.idle(lane);
          }
          for (const { stream, message } of taken.messages) start(lane, stream, message);
          took = taken.messages.length;
        } catch (error) {
          // One lane's trouble (its node failing over, a lost group) must not stall the others.
          groups.failed(lane, error);
        }
        free -= took;
        started += took;
        // A lane that gave fewer than asked is empty or capped for now: not asked again in this read.
        if (took < pick.count) candidates = candidates.filter((l) => l !== lane);
      }
    }
    // Nothing to take: wait for a wake-up; a capped lane frees up as its jobs finish, so look again soon.
    if (started === 0 && block > 0) await source.wait(capped ? Math.min(block, READER_DEFAULTS.cappedWaitMs) : block);
    return started;
  }

  return { read, lanes: () => source.active() };
}
