/**
 * The reclaimer: takes over messages other consumers left pending past the
 * claim idle time (a crash, a stall), with XAUTOCLAIM, lane by lane and, in
 * each lane, stream by stream in the lane's order.
 */
import type { RedisClient } from "../clients.ts";
import { RECLAIM_SCRIPT } from "./reclaim_script.ts";
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
  /** How long a reclaim's record is kept, for a resend of that reclaim (see `reclaim_script.ts`). */
  recordMs: 120_000,
} as const;

type RawEntry = [id: string, fields: string[] | null];

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
    const [next, entries] = await RECLAIM_SCRIPT.run(
      redis,
      [stream.stream, reclaimRecordKey(stream.stream, consumer)],
      [
        stream.group,
        consumer,
        options.claimIdleMs,
        cursors.get(stream.stream) ?? RECLAIMER_DEFAULTS.firstCursor,
        count,
        crypto.randomUUID(),
        RECLAIMER_DEFAULTS.recordMs,
      ],
    ) as [string, RawEntry[]];
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
