/**
 * The reader: takes new messages from the lanes with work into a worker's
 * free slots, sharing them fairly by weighted cost (see
 * `lane_shares.ts`), each lane within its in-flight cap.
 */
import type { RedisClient } from "../clients.ts";
import { defineScript } from "../redis/script.ts";
import type { GroupCache } from "./consumer_group.ts";
import type { LaneShares } from "./lane_shares.ts";
import type { LaneSource } from "./lanes.ts";
import { fieldsToObject, type QueueNames, type StreamMessage } from "./message.ts";

/** Defaults of {@linkcode createLaneReader}. */
export const READER_DEFAULTS = {
  /** The longest wait for a wake-up while a capped lane has work: it frees up as its jobs finish. */
  cappedWaitMs: 50,
} as const;

type RawEntry = [id: string, fields: string[] | null];

// TAKE_WITHIN_CAP: reads new messages for a consumer, but never more than leave `cap` pending in the group
// across all consumers: a tenant's in-flight cap, checked and taken in one step.
// KEYS[1]  the stream.
// ARGV[1]  the group.
// ARGV[2]  the consumer.
// ARGV[3]  how many messages to read at most.
// ARGV[4]  the cap on the group's pending messages (0 = no cap).
// Returns {capped (1 when the cap stopped the read), entries}.
const TAKE_WITHIN_CAP = defineScript(`
local count = tonumber(ARGV[3])
local cap = tonumber(ARGV[4])
if cap > 0 then
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1])[1]
  count = math.min(count, cap - pending)
  if count <= 0 then return {1, {}} end
end
local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', count, 'STREAMS', KEYS[1], '>')
if not reply then return {0, {}} end
return {0, reply[1][2]}`);

/** Options for {@linkcode createLaneReader}. */
export interface LaneReaderOptions {
  consumer: string;
  lanes: LaneSource;
  groups: GroupCache;
  shares: LaneShares;
  /** The most messages of one lane pending across all consumers (0 or none: no cap). */
  laneMaxInFlight?: number;
  /** Lanes not to read for now (a tenant whose budget is spent); asked on every read. */
  skip?: (lane: QueueNames) => boolean;
  /** Each lane's weight; asked once per read. Default: every lane weighs 1. */
  weights?: () => Promise<(lane: QueueNames) => number>;
}

/** The reader of one worker. */
export interface LaneReader {
  /**
   * Reads up to `free` new messages, passing each to `start`; with none to take, waits up to `block` ms for a
   * wake-up. `lanes`: the lanes with work, when the caller looked them up already (see `lanes()`).
   * @returns how many were started.
   */
  read(
    free: number,
    block: number,
    start: (lane: QueueNames, message: StreamMessage) => void,
    lanes?: Promise<QueueNames[]>,
  ): Promise<number>;
  /** The lanes with work now, for a `read` that follows: a caller may look them up beside another round trip. */
  lanes(): Promise<QueueNames[]>;
}

/** Creates the reader of one worker. */
export function createLaneReader({ redis }: { redis: RedisClient }, options: LaneReaderOptions): LaneReader {
  const { consumer, groups, shares, lanes: source } = options;
  let lastServed = "";

  /** Takes from one lane, within its in-flight cap. @returns the messages, and whether the cap stopped it. */
  async function take(lane: QueueNames, count: number): Promise<{ messages: StreamMessage[]; capped: boolean }> {
    await groups.ready(lane);
    const [capped, entries] = await TAKE_WITHIN_CAP.run(redis, [lane.stream], [
      lane.group,
      consumer,
      count,
      options.laneMaxInFlight ?? 0,
    ]) as [number, RawEntry[]];
    // A new message has been delivered exactly once.
    const messages = entries.filter((e): e is [string, string[]] => e[1] !== null)
      .map(([id, flat]) => ({ id, fields: fieldsToObject(flat), deliveries: 1 }));
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
    start: (lane: QueueNames, m: StreamMessage) => void,
    ahead?: Promise<QueueNames[]>,
  ) {
    const active = await (ahead ?? source.active());
    const lanes = options.skip ? active.filter((lane) => !options.skip!(lane)) : active;
    let started = 0;
    let capped = false;
    if (lanes.length > 0) {
      const weightOf = options.weights ? await options.weights() : () => 1;
      shares.begin(lanes.map((lane) => ({ id: lane.stream, weight: weightOf(lane) })));
      // Round-robin order from one lane after the one served first last time. Keep asking until the free
      // slots are used or every lane has said it has no more: an empty or capped lane never leaves a slot
      // idle while another lane has work.
      const at = lanes.findIndex((l) => l.stream > lastServed);
      const first = at < 0 ? 0 : at;
      let candidates = [...lanes.slice(first), ...lanes.slice(0, first)];
      for (let asked = 0; free > 0 && candidates.length > 0; asked++) {
        const pick = shares.next(candidates.map((l) => l.stream), free);
        const lane = candidates.find((l) => l.stream === pick.lane)!;
        if (asked === 0) lastServed = lane.stream;
        let took = 0;
        try {
          const taken = await take(lane, pick.count);
          capped ||= taken.capped;
          if (taken.messages.length === 0 && !taken.capped) {
            shares.drained(lane.stream);
            await source.idle(lane);
          }
          for (const m of taken.messages) start(lane, m);
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
