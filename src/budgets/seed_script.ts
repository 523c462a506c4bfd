import type { RedisClient } from "../clients.ts";
import { defineScript } from "../redis/script.ts";
import { type Limits, runOnHash } from "./budget_hash.ts";

// SEED: raises the current periods' spend to at least what Postgres recorded (a budget set in the middle of a day
// counts the day's spend so far; a hash lost in Redis is rebuilt), and marks the hash seeded.
// KEYS[1]  the tenant's budget hash (its fields: budget_hash.ts).
// ARGV[1]  JSON: {spent: [tokens/day, nano-USD/day, tokens/month, nano-USD/month] by Postgres's record, ttl_ms, and
//          the caller's periods: day, month, ...}.
// Answers {-3, now} (nothing written) when Redis's day is not the caller's; else {1}.
// Safe to run twice: it only ever raises a field to the same value, and sets marks that are set.
const SEED = defineScript(`
local key = KEYS[1]
local a = cjson.decode(ARGV[1])
local d, m = 'd' .. a.day, 'm' .. a.month
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if math.floor(now / 86400000) ~= a.day then return {-3, now} end
for i, field in ipairs({d .. ':tok', d .. ':usd', m .. ':tok', m .. ':usd'}) do
  local have = tonumber(redis.call('HGET', key, field)) or 0
  if a.spent[i] > have then redis.call('HSET', key, field, a.spent[i]) end
end
redis.call('HSETNX', key, 'day', a.day)
redis.call('HSETNX', key, 'month', a.month)
redis.call('HSET', key, 'seeded', 1)
redis.call('HSETNX', key, 'inc', t[1] .. '.' .. t[2])
redis.call('PEXPIRE', key, a.ttl_ms)
return {1}
`);

/** Runs the seed script: the current periods' spend becomes at least `spent`. */
export async function seedBudgetState(redis: RedisClient, key: string, spent: Limits): Promise<void> {
  await runOnHash(redis, undefined, SEED, key, { spent });
}
