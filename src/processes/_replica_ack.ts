import type { RedisClient } from "../clients.ts";
import type { Config } from "../config.ts";
import { createReplicaAck, type ReplicaAck } from "../redis/replica_ack.ts";

/** The WAIT runner REDIS_MIN_REPLICAS_ACK asks for, or none (no WAIT) when it is 0. The caller closes it. */
export function replicaAckOf(config: Config, redis: RedisClient): ReplicaAck | undefined {
  if (config.REDIS_MIN_REPLICAS_ACK === 0) return undefined;
  return createReplicaAck(redis, { replicas: config.REDIS_MIN_REPLICAS_ACK, timeoutMs: config.REDIS_ACK_TIMEOUT_MS });
}
