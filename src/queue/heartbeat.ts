/**
 * The heartbeat service: keeps the messages a consumer is still working on
 * from being reclaimed, by refreshing their idle time in the group's PEL
 * every `intervalMs` (a fraction of the claim idle time).
 */
import type { RedisClient } from "../clients.ts";
import { every } from "../async/every.ts";
import type { Logger } from "../log/logger.ts";
import { REFRESH_OWNED_SCRIPT } from "./refresh_owned_script.ts";
import { type AckItem, groupByStream } from "./ack_batcher.ts";

/** Defaults of {@linkcode createHeartbeat}. */
export const HEARTBEAT_DEFAULTS = {
  /** Beats per claim idle time: a message is refreshed this many times before another consumer may take it. */
  perClaimIdle: 4,
  /** The shortest interval between beats, whatever the claim idle time. */
  minIntervalMs: 50,
} as const;

/** The heartbeat interval for a claim idle time, unless one is given. */
export function heartbeatInterval(claimIdleMs: number, given?: number): number {
  return given ?? Math.max(HEARTBEAT_DEFAULTS.minIntervalMs, Math.floor(claimIdleMs / HEARTBEAT_DEFAULTS.perClaimIdle));
}

/** The heartbeat of one consumer. */
export interface Heartbeat {
  /** Refreshes the idle time of the held messages this consumer still owns. @returns the ids refreshed. */
  beat(): Promise<string[]>;
  /** Beats every `intervalMs` until the returned function is called. */
  start(): () => void;
}

/** Creates the heartbeat of `consumer`, for the messages `held()` names. */
export function createHeartbeat(
  { redis, log }: { redis: RedisClient; log: Logger },
  { consumer, intervalMs, held }: { consumer: string; intervalMs: number; held: () => AckItem[] },
): Heartbeat {
  async function beat(): Promise<string[]> {
    const items = held();
    if (items.length === 0) return [];
    const refreshed: string[] = [];
    // The streams of a beat at once (their lanes are as many as the messages held, at most): one round trip.
    await Promise.all([...groupByStream(items).values()].map(async ({ stream, ids }) => {
      const ok = await REFRESH_OWNED_SCRIPT.run(redis, [stream.stream], [stream.group, consumer, ...ids]) as string[];
      refreshed.push(...ok);
      if (ok.length < ids.length) {
        const lost = ids.filter((id) => !ok.includes(id));
        log.warn("messages_reclaimed_by_another_consumer", { stream: stream.stream, msg_ids: lost });
      }
    }));
    return refreshed;
  }
  return {
    beat,
    start: () => every(intervalMs, beat, (error) => log.warn("heartbeat_failed", { error })),
  };
}
