/**
 * The reclaimer: takes over messages other consumers left pending past the
 * claim idle time (a crash, a stall), with XAUTOCLAIM, lane by lane and, in
 * each lane, stream by stream in the lane's order.
 */
import type { RedisClient } from "../clients.ts";
import { defineScript } from "../redis/script.ts";
import type { GroupCache } from "./consumer_group.ts";
import type { LaneSource } from "./lanes.ts";
import { type LaneNames, type QueueNames, type StreamMessage, streamsOf } from "./message.ts";
import { fieldsToObject } from "../redis/fields.ts";

/** Defaults of {@linkcode createReclaimer}. */
export const RECLAIMER_DEFAULTS = {
  /** The delivery count assumed for a reclaimed message the PEL no longer lists (it was reclaimed at least once). */
  unknownDeliveries: 2,
  /** Where XAUTOCLAIM starts scanning a lane's PEL the first time. */
  firstCursor: "0-0",
  /** How long a reclaim's record is kept, for a resend of that reclaim (see RECLAIM). */
  recordMs: 120_000,
} as const;

type RawEntry = [id: string, fields: string[] | null];

// RECLAIM: takes over the messages of a lane's stream idle past the claim idle time (XAUTOCLAIM).
// KEYS[1]  the stream.
// KEYS[2]  the consumer's reclaim record of the stream (reclaimRecordKey): the last reclaim's id, its next cursor and
//          the ids it claimed.
// ARGV[1]  the group.   ARGV[2]  the consumer.   ARGV[3]  the claim idle time, in ms.   ARGV[4]  the cursor.
// ARGV[5]  how many messages to claim at most.   ARGV[6]  this reclaim's id.   ARGV[7]  the record's lifetime, in ms.
// Returns XAUTOCLAIM's {next cursor, entries}.
// Safe to run twice: the client resends a reclaim whose reply was lost with its connection, and Redis may have run
// it. Run again, XAUTOCLAIM would pass over the messages the first run claimed (idle no more), and those would wait
// another claim idle time and spend one more delivery, perhaps their last. So the reclaim whose id the record holds
// answers what it claimed, those messages still pending to this consumer.
const RECLAIM = defineScript(`
local record = redis.call('GET', KEYS[2])
if record then
  local call, next, ids = string.match(record, '^(%S+) (%S+) (.*)$')
  if call == ARGV[6] then
    local entries = {}
    for id in string.gmatch(ids, '[^,]+') do
      if #redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1, ARGV[2]) == 1 then
        local entry = redis.call('XRANGE', KEYS[1], id, id)[1]
        if entry then entries[#entries + 1] = entry end
      end
    end
    return {next, entries}
  end
end
local claimed = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], 'COUNT', ARGV[5])
local ids = {}
for i, entry in ipairs(claimed[2]) do ids[i] = entry[1] end
if #ids > 0 then
  redis.call('SET', KEYS[2], ARGV[6] .. ' ' .. claimed[1] .. ' ' .. table.concat(ids, ','), 'PX', ARGV[7])
end
return {claimed[1], claimed[2]}`);

/** The record of `consumer`'s last reclaim from `stream`, a stream of a lane, in the lane's slot. */
export function reclaimRecordKey(stream: string, consumer: string): string {
  return `${stream}:reclaimed:${consumer}`;
}

/** Options for {@linkcode createReclaimer}. */
export interface ReclaimerOptions {
  consumer: string;
  /** Idle time after which another consumer may reclaim a pending message. */
  claimIdleMs: number;
  /** The least time between two passes over the lanes. */
  intervalMs: number;
  lanes: LaneSource;
  groups: GroupCache;
  /** Whether this consumer already holds the message (it is running here): such an entry is not started again. */
  holds(stream: QueueNames, id: string): boolean;
  /** How many messages this consumer holds. */
  held(): number;
}

/** The reclaimer of one worker. */
export interface Reclaimer {
  /**
   * Reclaims up to `free` idle messages, passing each to `start` with its lane and stream, at most once per
   * `intervalMs`; each pass starts one lane further on, so one lane's stream of failures cannot take every pass.
   * @returns how many.
   */
  reclaim(free: number, start: (lane: LaneNames, stream: QueueNames, message: StreamMessage) => void): Promise<number>;
}

/** Creates the reclaimer of one worker. */
export function createReclaimer({ redis }: { redis: RedisClient }, options: ReclaimerOptions): Reclaimer {
  const { consumer, groups } = options;
  // Each stream's XAUTOCLAIM cursor: kept, or every call rescans the PEL from the start.
  const cursors = new Map<string, string>();
  let turn = 0;
  let last = -Infinity;

  async function reclaimStream(stream: QueueNames, count: number): Promise<StreamMessage[]> {
    // The reclaim's id is made before it is sent: a resend of it carries the same one.
    const [next, entries] = await RECLAIM.run(redis, [stream.stream, reclaimRecordKey(stream.stream, consumer)], [
      stream.group,
      consumer,
      options.claimIdleMs,
      cursors.get(stream.stream) ?? RECLAIMER_DEFAULTS.firstCursor,
      count,
      crypto.randomUUID(),
      RECLAIMER_DEFAULTS.recordMs,
    ]) as [string, RawEntry[]];
    cursors.set(stream.stream, next);
    const live = entries.filter((e): e is [string, string[]] => e[1] !== null && !options.holds(stream, e[0]));
    if (live.length === 0) return [];
    // XAUTOCLAIM bumped each delivery count; read the counts back from the PEL.
    const counts = new Map<string, number>();
    const ids = live.map(([id]) => id);
    const pending = await redis.xpending(
      stream.stream,
      stream.group,
      ids[0]!,
      ids[ids.length - 1]!,
      // Our in-flight entries may sit in the same id range; ask for enough rows to cover them too.
      ids.length + options.held(),
      consumer,
    ) as [string, string, number, number][];
    for (const [id, , , times] of pending) counts.set(id, times);
    return live.map(([id, flat]) => ({
      id,
      fields: fieldsToObject(flat),
      deliveries: counts.get(id) ?? RECLAIMER_DEFAULTS.unknownDeliveries,
    }));
  }

  return {
    async reclaim(free, start) {
      if (performance.now() - last < options.intervalMs) return 0;
      last = performance.now();
      let started = 0;
      const lanes = await options.lanes.all();
      const first = lanes.length ? turn++ % lanes.length : 0;
      for (let i = 0; i < lanes.length && free - started > 0; i++) {
        const lane = lanes[(first + i) % lanes.length]!;
        try {
          await groups.ready(lane);
          for (const stream of streamsOf(lane)) {
            if (free - started <= 0) break;
            const reclaimed = await reclaimStream(stream, free - started);
            for (const m of reclaimed) start(lane, stream, m);
            started += reclaimed.length;
          }
        } catch (error) {
          // One lane's trouble (its node failing over, a lost group) must not stall the others.
          groups.failed(lane, error);
        }
      }
      return started;
    },
  };
}
