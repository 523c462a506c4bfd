/**
 * The heartbeat service: keeps the messages a consumer is still working on
 * from being reclaimed, by refreshing their idle time in the group's PEL
 * every `intervalMs` (a fraction of the claim idle time).
 */
import type { RedisClient } from "../clients.ts";
import { every } from "../async/every.ts";
import type { Logger } from "../log/logger.ts";
import { defineScript } from "../redis/script.ts";
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

// REFRESH_OWNED: refreshes the idle time of the entries a consumer still owns, and only those.
// KEYS[1]  the stream.
// ARGV[1]  the group.
// ARGV[2]  the consumer (an argument, not a key: on Redis Cluster every key must be in one slot).
// ARGV[3…] the entry ids.
// Returns the ids refreshed.
// Checking the owner and claiming in one script means a worker that stalled never steals back a message another
// worker has already reclaimed. XCLAIM ... JUSTID resets the idle time without bumping the delivery count.
// Safe to run twice (a resend after a lost reply): the owner is checked again, and the idle time reset again.
const REFRESH_OWNED = defineScript(`
local refreshed = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    table.insert(refreshed, ARGV[i])
  end
end
return refreshed`);

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
    for (const { stream, ids } of groupByStream(items).values()) {
      const ok = await REFRESH_OWNED.run(redis, [stream.stream], [stream.group, consumer, ...ids]) as string[];
      refreshed.push(...ok);
      if (ok.length < ids.length) {
        const lost = ids.filter((id) => !ok.includes(id));
        log.warn("messages_reclaimed_by_another_consumer", { stream: stream.stream, msg_ids: lost });
      }
    }
    return refreshed;
  }
  return {
    beat,
    start: () => every(intervalMs, beat, (error) => log.warn("heartbeat_failed", { error })),
  };
}
