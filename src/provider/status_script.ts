import type { RedisClient } from "../clients.ts";
import { defineScript } from "../redis/script.ts";
import { fieldsToObject } from "../redis/fields.ts";

const READ_STATE = defineScript(`
-- Read state: the provider's state hash with Redis's own clock, so every worker sees the same now.
-- KEYS[1]  the provider's state hash
-- KEYS[2]  the live processes' configured limits beside it
-- Returns {now ms, flat field/value list of the state, flat owner/entry list of the configurations}.
local t = redis.call('TIME')
return {tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), redis.call('HGETALL', KEYS[1]),
  redis.call('HGETALL', KEYS[2])}
`);

/** The provider state hash `key` and the live configurations `configKey` as maps, with Redis's time. */
export async function readProviderState(
  redis: RedisClient,
  key: string,
  configKey: string,
): Promise<{ now: number; fields: Map<string, string>; configs: Map<string, string> }> {
  const [now, flat, configs] = await READ_STATE.run(redis, [key, configKey], []) as [number, string[], string[]];
  return {
    now,
    fields: new Map(Object.entries(fieldsToObject(flat))),
    configs: new Map(Object.entries(fieldsToObject(configs))),
  };
}
