import type { RedisClient } from "../clients.ts";
import type { JobKeys, ServiceKeys } from "./keys.ts";

/** One lane as operators see it: its tenant (none for a one-stream queue) and its keys. */
export interface LaneRef {
  tenant: string | null;
  keys: JobKeys;
}

/**
 * Every lane there is: each tenant's lane in the registry, by name. With
 * plain {@linkcode JobKeys} (one stream), just that.
 */
export async function allLanes(redis: RedisClient, keys: ServiceKeys | JobKeys): Promise<LaneRef[]> {
  if (!("lane" in keys)) return [{ tenant: null, keys }];
  const tenants = (await redis.smembers(keys.registry.all)).sort();
  return tenants.map((tenant) => ({ tenant, keys: keys.lane(tenant) }));
}
