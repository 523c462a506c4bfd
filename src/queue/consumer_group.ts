import type { RedisClient } from "../clients.ts";
import type { Logger } from "../log/logger.ts";
import { laneId, type LaneNames, type QueueNames } from "./message.ts";

/** Ensures the consumer group exists (creating the stream if needed). */
export async function ensureGroup(redis: RedisClient, names: QueueNames): Promise<void> {
  try {
    await redis.xgroup("CREATE", names.stream, names.group, "0", "MKSTREAM");
  } catch (error) {
    if (!(error instanceof Error) || !error.message.startsWith("BUSYGROUP")) throw error;
  }
}

/** The streams whose group this process has made sure of, so each is created once, not before every read. */
export interface GroupCache {
  /**
   * Ensures the group of each of `lane`'s streams once per process (again after {@linkcode GroupCache.failed}
   * saw it lost).
   */
  ready(lane: LaneNames): Promise<void>;
  /** A command on `lane` failed: logs it, and forgets its streams' groups if Redis says one is gone (NOGROUP). */
  failed(lane: LaneNames, error: unknown): void;
}

/** Creates the group cache of one worker. */
export function createGroupCache({ redis, log }: { redis: RedisClient; log: Logger }): GroupCache {
  const ready = new Set<string>();
  return {
    async ready(lane) {
      for (const stream of lane.streams) {
        if (ready.has(stream)) continue;
        await ensureGroup(redis, { stream, dead: lane.dead, group: lane.group });
        ready.add(stream);
      }
    },
    failed(lane, error) {
      if (error instanceof Error && error.message.includes("NOGROUP")) {
        for (const stream of lane.streams) ready.delete(stream);
      }
      log.warn("lane_read_failed", { stream: laneId(lane), error });
    },
  };
}
