import type { Cluster, Redis } from "ioredis";

/**
 * A Redis client: one server (named in REDIS_URL, or the master its
 * sentinels name), or a Redis Cluster (same commands; every multi-key step
 * stays in one slot). `clients.ts` connects one and exports this type too.
 */
export type RedisClient = Redis | Cluster;
