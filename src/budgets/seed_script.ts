import type { RedisClient } from "../clients.ts";
import { defineScript } from "../redis/script.ts";
import { type Limits, runOnHash, whole } from "./budget_hash.ts";

// SEED: raises the current periods' spend to at least what Postgres recorded (a budget set in the middle of a day
// counts the day's spend so far; a hash lost in Redis is rebuilt), and marks the hash seeded.
// KEYS[1]  the tenant's budget hash (its fields: budget_hash.ts).
// ARGV[1]  JSON: {spent: [tokens/day, nano-USD/day, tokens/month, nano-USD/month] by Postgres's record, holds:
//          [[run id, tokens, nano-USD], ...] (the batch lines in flight not yet charged in that record), rebuild
//          (true: a hash found lost; false: a budget set), ttl_ms, and the caller's periods: day, month, ...}.
// A rebuild of a hash another process has seeded meanwhile does nothing: the first seed stands whole. Its spend and
// its holds were read in one snapshot, so a line is in one or the other; raising the spend to a later snapshot's
// would count a line charged since in both (its hold, still here, charges it again when it settles). The holds
// are written only by the seed that marks the hash seeded (a hash that kept its holds has them).
// Answers {-3, now} (nothing written) when Redis's day is not the caller's; else {1, 1 when it seeded or 0}.
// Safe to run twice: it only ever raises a field to the same value, and sets marks that are set.
const SEED = defineScript(`
local key = KEYS[1]
local a = cjson.decode(ARGV[1])
local d, m = 'd' .. a.day, 'm' .. a.month
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if math.floor(now / 86400000) ~= a.day then return {-3, now} end
local seeded = redis.call('HEXISTS', key, 'seeded') == 1
if seeded and a.rebuild then return {1, 0} end
for i, field in ipairs({d .. ':tok', d .. ':usd', m .. ':tok', m .. ':usd'}) do
  local have = tonumber(redis.call('HGET', key, field)) or 0
  if a.spent[i] > have then redis.call('HSET', key, field, a.spent[i]) end
end
redis.call('HSETNX', key, 'day', a.day)
redis.call('HSETNX', key, 'month', a.month)
if not seeded then
  for _, h in ipairs(a.holds) do
    if redis.call('HSETNX', key, 'B:' .. h[1], now .. ',' .. h[2] .. ',' .. h[3]) == 1 then
      if h[2] > 0 then redis.call('HINCRBY', key, 'bh:tok', h[2]) end
      if h[3] > 0 then redis.call('HINCRBY', key, 'bh:usd', h[3]) end
    end
  end
end
redis.call('HSET', key, 'seeded', 1)
redis.call('HSETNX', key, 'inc', t[1] .. '.' .. t[2])
redis.call('PEXPIRE', key, a.ttl_ms)
return {1, 1}
`);

/** A batch line in flight, held against its tenant's budgets: its run id and worst case at batch prices. */
export interface LineHold {
  id: string;
  tokens: number;
  nanos: number;
}

/**
 * Runs the seed script: the current periods' spend becomes at least `spent`, and a hash not seeded before holds
 * `holds`. With `rebuild`, a hash seeded meanwhile is left as it is.
 */
export async function seedBudgetState(
  redis: RedisClient,
  key: string,
  spent: Limits,
  { holds = [], rebuild = false }: { holds?: readonly LineHold[]; rebuild?: boolean } = {},
): Promise<void> {
  await runOnHash(redis, undefined, SEED, key, {
    spent,
    holds: holds.map((h) => [h.id, whole(h.tokens), whole(h.nanos)]),
    rebuild,
  });
}
