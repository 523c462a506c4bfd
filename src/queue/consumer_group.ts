import type { RedisClient } from "../clients.ts";
import type { Logger } from "../log/logger.ts";
import type { QueueNames } from "./message.ts";

/** Ensures the consumer group exists (creating the stream if needed). */
export async function ensureGroup(redis: RedisClient, names: QueueNames): Promise<void> {
  try {
    await redis.xgroup("CREATE", names.stream, names.group, "0", "MKSTREAM");
  } catch (error) {
    if (!(error instanceof Error) || !error.message.startsWith("BUSYGROUP")) throw error;
  }
}

/** The lanes whose group this process has made sure of, so each is created once, not before every read. */
export interface GroupCache {
  /** Ensures `lane`'s group once per process (again after {@linkcode GroupCache.failed} saw it lost). */
  ready(lane: QueueNames): Promise<void>;
  /** A command on `lane` failed: logs it, and forgets the group if Redis says it is gone (NOGROUP). */
  failed(lane: QueueNames, error: unknown): void;
}

/** Creates the group cache of one worker. */
export function createGroupCache({ redis, log }: { redis: RedisClient; log: Logger }): GroupCache {
  const ready = new Set<string>();
  return {
    async ready(lane) {
      if (ready.has(lane.stream)) return;
      await ensureGroup(redis, lane);
      ready.add(lane.stream);
    },
    failed(lane, error) {
      if (error instanceof Error && error.message.includes("NOGROUP")) ready.delete(lane.stream);
      log.warn("lane_read_failed", { stream: lane.stream, error });
    },
  };
}
