import type { RedisClient } from "../clients.ts";
import { defineScript } from "../redis/script.ts";
import { fieldsToObject } from "../queue/message.ts";

const READ_STATE = defineScript(`
-- Read state: the provider's state hash with Redis's own clock, so every worker sees the same now.
-- KEYS[1]  the provider's state hash
-- Returns {now ms, flat field/value list}.
local t = redis.call('TIME')
return {tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), redis.call('HGETALL', KEYS[1])}
`);

/** The provider state hash `key` as a map, with Redis's time. */
export async function readProviderState(
  redis: RedisClient,
  key: string,
): Promise<{ now: number; fields: Map<string, string> }> {
  const [now, flat] = await READ_STATE.run(redis, [key], []) as [number, string[]];
  return { now, fields: new Map(Object.entries(fieldsToObject(flat))) };
}
