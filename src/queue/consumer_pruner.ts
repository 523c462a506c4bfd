/**
 * The consumer pruner: every process restart adds a consumer name to each
 * group it reads (one per stream of each lane), so consumers that hold nothing and have been idle long
 * enough are removed, on an interval of their own, walking the lanes a bounded batch at a time.
 */
import type { RedisClient } from "../clients.ts";
import { every } from "../async/every.ts";
import type { Logger } from "../log/logger.ts";
import { DELETE_IDLE_CONSUMER_SCRIPT } from "./delete_idle_consumer_script.ts";
import type { GroupCache } from "./consumer_group.ts";
import type { LaneSource } from "./lanes.ts";
import { fieldsToObject } from "../redis/fields.ts";
import { type LaneNames, streamsOf } from "./message.ts";

/** Defaults of {@linkcode createConsumerPruner}. */
export const PRUNER_DEFAULTS = {
  /** A consumer is pruned once idle this many claim idle times… */
  claimIdles: 3,
  /** …and never before this long. */
  minIdleMs: 60_000,
  /** The longest interval between two passes. */
  maxIntervalMs: 60_000,
} as const;

/** How long a consumer must be idle before it is pruned, unless given. */
export function pruneIdle(claimIdleMs: number, given?: number): number {
  return given ?? Math.max(PRUNER_DEFAULTS.claimIdles * claimIdleMs, PRUNER_DEFAULTS.minIdleMs);
}

/** Options for {@linkcode createConsumerPruner}. */
export interface ConsumerPrunerOptions {
  /** This process's consumer: never pruned by itself. */
  consumer: string;
  lanes: LaneSource;
  groups: GroupCache;
  /** Consumers idle this long with nothing pending are removed. */
  idleMs: number;
  /** Test seam: after `XINFO CONSUMERS` named `consumer` as idle, before it is removed. */
  beforePrune?(consumer: string): Promise<void>;
}

/** The consumer pruner of one worker. */
export interface ConsumerPruner {
  /** Removes other consumers that hold nothing and have been idle past `idleMs`. @returns their names. */
  prune(): Promise<string[]>;
  /** Prunes on an interval until the returned function is called. */
  start(): () => void;
}

/** Creates the consumer pruner of one worker. */
export function createConsumerPruner(
  { redis, log }: { redis: RedisClient; log: Logger },
  options: ConsumerPrunerOptions,
): ConsumerPruner {
  const { consumer, idleMs, groups } = options;
  /** Removes the idle consumers of one lane's streams. @returns their names (once per lane). */
  async function pruneLane(lane: LaneNames): Promise<string[]> {
    // Named once per lane, though it leaves the group of each of the lane's streams.
    const fromLane = new Set<string>();
    for (const stream of streamsOf(lane)) {
      let consumers: unknown[][];
      try {
        consumers = await redis.call("XINFO", "CONSUMERS", stream.stream, stream.group) as unknown[][];
      } catch (error) {
        // No group (or no stream) yet: no consumer to prune.
        if (error instanceof Error && /NOGROUP|no such key/i.test(error.message)) continue;
        groups.failed(lane, error);
        break;
      }
      for (const c of consumers) {
        const f = fieldsToObject(c);
        const name = String(f.name);
        // Only consumers with an empty PEL: deleting one that holds messages would drop them from the PEL.
        if (name === consumer || Number(f.pending) !== 0 || Number(f.idle) < idleMs) continue;
        await options.beforePrune?.(name);
        const gone = await DELETE_IDLE_CONSUMER_SCRIPT.run(redis, [stream.stream], [stream.group, name, idleMs]);
        if (gone === 1) fromLane.add(name);
      }
    }
    return [...fromLane];
  }
  /** One pass over every lane, a bounded batch at a time, the lanes of a batch at once. */
  async function prune(): Promise<string[]> {
    const removed: string[] = [];
    const walk = options.lanes.walk();
    for (let done = false; !done;) {
      const batch = await walk.next();
      done = batch.done;
      for (const names of await Promise.all(batch.lanes.map(pruneLane))) removed.push(...names);
    }
    if (removed.length) log.info("consumers_pruned", { consumers: removed });
    return removed;
  }
  return {
    prune,
    start: () =>
      every(
        Math.min(idleMs, PRUNER_DEFAULTS.maxIntervalMs),
        prune,
        (error) => log.warn("consumer_prune_failed", { error }),
      ),
  };
}
