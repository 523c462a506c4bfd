/**
 * The reclaimer: takes over messages other consumers left pending past the
 * claim idle time (a crash, a stall), with XAUTOCLAIM, lane by lane and, in
 * each lane, stream by stream in the lane's order. A pass walks every lane a
 * bounded batch per read, asking each batch at once which lanes hold idle
 * messages (one XPENDING per stream), and reclaims from those only: no read
 * waits for a pass over 20,000 lanes.
 */
import type { RedisClient } from "../clients.ts";
import { RECLAIM_SCRIPT } from "./reclaim_script.ts";
import type { GroupCache } from "./consumer_group.ts";
import type { LaneSource, LaneWalk } from "./lanes.ts";
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
   * Reclaims up to `free` idle messages, passing each to `start` with its lane and stream. A pass over the lanes
   * starts at most once per `intervalMs` and goes on a batch per call; a lane that may hold more than it gave goes
   * to the back of those found, so one lane's stream of failures cannot take every call.
   * @returns how many.
   */
  reclaim(free: number, start: (lane: LaneNames, stream: QueueNames, message: StreamMessage) => void): Promise<number>;
}

/** Creates the reclaimer of one worker. */
export function createReclaimer({ redis }: { redis: RedisClient }, options: ReclaimerOptions): Reclaimer {
  const { consumer, groups } = options;
  // Each stream's XAUTOCLAIM cursor: kept, or every call rescans the PEL from the start.
  const cursors = new Map<string, string>();
  // The pass in progress, and the lanes it found holding idle messages, not yet reclaimed.
  let walk: LaneWalk | undefined;
  let passStarted = -Infinity;
  const due: LaneNames[] = [];

  /** Whether any stream of `lane` has a message pending past the claim idle time (a lane never read has none). */
  async function holdsIdle(lane: LaneNames): Promise<boolean> {
    const found = await Promise.all(lane.streams.map(async (stream) => {
      try {
        const idle = await redis.call("XPENDING", stream, lane.group, "IDLE", options.claimIdleMs, "-", "+", 1);
        return (idle as unknown[]).length > 0;
      } catch (error) {
        // No group (or no stream) yet: nothing pending. Anything else: look at the lane, as before.
        return !(error instanceof Error && /NOGROUP|no such key/i.test(error.message));
      }
    }));
    return found.includes(true);
  }

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
      if (due.length === 0) {
        if (!walk) {
          if (performance.now() - passStarted < options.intervalMs) return 0;
          passStarted = performance.now();
          walk = options.lanes.walk();
        }
        const batch = await walk.next();
        if (batch.done) walk = undefined;
        const idle = await Promise.all(batch.lanes.map(holdsIdle));
        due.push(...batch.lanes.filter((_, i) => idle[i]));
      }
      let started = 0;
      while (due.length > 0 && free - started > 0) {
        const lane = due.shift()!;
        let more = false;
        try {
          await groups.ready(lane);
          for (const stream of streamsOf(lane)) {
            const want = free - started;
            if (want <= 0) {
              more = true;
              break;
            }
            const reclaimed = await reclaimStream(stream, want);
            for (const m of reclaimed) start(lane, stream, m);
            started += reclaimed.length;
            if (reclaimed.length === want) more = true;
          }
        } catch (error) {
          // One lane's trouble (its node failing over, a lost group) must not stall the others.
          groups.failed(lane, error);
        }
        if (more) due.push(lane);
      }
      return started;
    },
  };
}
