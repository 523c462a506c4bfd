import type { RedisClient } from "../clients.ts";
import { defineScript } from "../redis/script.ts";
import { type BudgetState, runOnHash, stateOf } from "./budget_hash.ts";

// READ: what the tenant's budget hash holds for the current periods, as one snapshot. Writes nothing.
// KEYS[1]  the tenant's budget hash (its fields: budget_hash.ts).
// ARGV[1]  JSON: the caller's periods {day, month, ...} (budget_hash.ts's periodsAt; the rest is not read).
// Answers {-3, now} when Redis's day is not the caller's; else {now ms, seeded (1 or 0), the spend fields
// (tokens/day, nano-USD/day, tokens/month, nano-USD/month), then one 'epoch,tokens,nano-USD' per open epoch and
// 'h,tokens,nano-USD' for the batch lines' holds, if any}:
// budget_hash.ts's stateOf counts them (reservations that never settled count as spent).
const READ = defineScript(`
local key = KEYS[1]
local a = cjson.decode(ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if math.floor(now / 86400000) ~= a.day then return {-3, now} end
local fields = redis.call('HMGET', key, 'seeded', 'd' .. a.day .. ':tok', 'd' .. a.day .. ':usd',
  'm' .. a.month .. ':tok', 'm' .. a.month .. ':usd')
local snapshot = {now, fields[1] and 1 or 0, fields[2], fields[3], fields[4], fields[5]}
for e in string.gmatch(redis.call('HGET', key, 'open') or '', '[^,]+') do
  local amounts = redis.call('HMGET', key, 'r' .. e .. ':tok', 'r' .. e .. ':usd')
  snapshot[#snapshot + 1] = e .. ',' .. (amounts[1] or '0') .. ',' .. (amounts[2] or '0')
end
local holds = redis.call('HMGET', key, 'bh:tok', 'bh:usd')
if holds[1] or holds[2] then snapshot[#snapshot + 1] = 'h,' .. (holds[1] or '0') .. ',' .. (holds[2] or '0') end
return snapshot
`);

/** Runs the read script: the current periods' spend and reservations, at Redis's clock. */
export async function readBudgetState(redis: RedisClient, key: string): Promise<BudgetState> {
  const { reply } = await runOnHash(redis, undefined, READ, key, {});
  const [now, seeded, ...snapshot] = reply;
  return stateOf(Number(now), Number(seeded) === 1, snapshot);
}
