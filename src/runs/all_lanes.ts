import type { RedisClient } from "../clients.ts";
import type { LaneKeys, ServiceKeys } from "./keys.ts";

/** One lane as operators see it: its tenant and its keys. */
export interface LaneRef {
  tenant: string;
  keys: LaneKeys;
}

/** Every lane there is: each tenant's lane in the registry, by name. */
export async function allLanes(redis: RedisClient, keys: ServiceKeys): Promise<LaneRef[]> {
  const tenants = (await redis.smembers(keys.registry.all)).sort();
  return tenants.map((tenant) => ({ tenant, keys: keys.lane(tenant) }));
}
