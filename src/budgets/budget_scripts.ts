/**
 * The budget scripts: a tenant's spend and in-flight reservations, per UTC
 * day and per UTC month, in one Redis hash under the tenant's own hash tag
 * (the slot of its lane, so it works on a Redis Cluster). Every decision is
 * one Lua script on that one key: reservations by any number of workers can
 * never together pass a limit. The periods come from Redis's own clock
 * (`TIME`), so workers on hosts with different clocks agree on when a day
 * ends.
 *
 * Four budgets, in this order everywhere: tokens per day, USD per day,
 * tokens per month, USD per month. USD are whole nano-dollars (see
 * `prices.ts`). A limit of -1 is no limit.
 *
 * Fields: `d<day>:tok|usd|rtok|rusd` (spent and reserved, day = days since
 * the epoch), `m<month>:...` (month = year * 12 + month - 1), `d<day>:flags`
 * / `m<month>:flags` (thresholds already announced), `day` / `month` (the
 * newest periods seen, for clean-up). A reservation settles against the
 * periods it was made in, so the previous day and month are kept.
 */
import type { RedisClient } from "../clients.ts";
import { defineScript } from "../redis/script.ts";

/** The four budgets' limits: tokens/day, nano-USD/day, tokens/month, nano-USD/month; -1 = none. */
export type Limits = [number, number, number, number];

/** How long a tenant's budget hash outlives its last use: past the previous month. */
export const BUDGET_STATE_TTL_MS = 70 * 24 * 3600 * 1000;

const PERIODS = `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local day = math.floor(now / 86400000)
-- The civil month of a day number (H. Hinnant's days_from_civil, inverted).
local z = day + 719468
local era = math.floor(z / 146097)
local doe = z - era * 146097
local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
local mp = math.floor((5 * doy + 2) / 153)
local mon = mp + 3
if mp >= 10 then mon = mp - 9 end
local year = yoe + era * 400
if mon <= 2 then year = year + 1 end
local month = year * 12 + mon - 1
`;

const READ = `
local function fields(d, m)
  local p = {'d' .. d, 'd' .. d, 'm' .. m, 'm' .. m}
  local unit = {'tok', 'usd', 'tok', 'usd'}
  local spent, reserved = {}, {}
  local h = redis.call('HMGET', key, p[1] .. ':tok', p[2] .. ':usd', p[3] .. ':tok', p[4] .. ':usd',
    p[1] .. ':rtok', p[2] .. ':rusd', p[3] .. ':rtok', p[4] .. ':rusd')
  for i = 1, 4 do
    spent[i] = tonumber(h[i]) or 0
    reserved[i] = math.max(0, tonumber(h[i + 4]) or 0)
  end
  return p, unit, spent, reserved
end
`;

const RESERVE = defineScript(`
-- Reserve (or check): whether a call's worst case fits every budget of the tenant, and in mode reserve, hold it.
-- KEYS[1]  the tenant's budget hash
-- ARGV[1..4]  the limits (tokens/day, nano-USD/day, tokens/month, nano-USD/month; -1 = none)
-- ARGV[5]  the worst case's tokens   ARGV[6]  its nano-USD   ARGV[7]  the hash's TTL in ms
-- ARGV[8]  mode: 'reserve' (counts what is reserved in flight and holds the worst case) or 'check' (an intake's
--          question: would it fit what is spent, reservations aside; holds nothing)
-- Returns {ok, budget (1..4, the first that refused; 0 when ok), limit, spent, reserved, now ms, day, month,
-- newly (the marks, 80 and/or 100, this refusal is the first of the period to reach, comma-separated)}.
local key = KEYS[1]
local lim = {tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])}
local tok, usd, ttl, mode = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8]
${PERIODS}
${READ}
local p, unit, spent, reserved = fields(day, month)
local want = {tok, usd, tok, usd}
for i = 1, 4 do
  local held = reserved[i]
  if mode == 'check' then held = 0 end
  if lim[i] >= 0 and spent[i] + held + want[i] > lim[i] then
    -- Refused: the budget is reached (100%), and so is 80% if spend had not passed it yet (a worst case can be
    -- refused below 80% spent). Each mark once per period.
    local newly = {}
    if mode == 'reserve' then
      local flags = redis.call('HGET', key, p[i] .. ':flags') or ''
      for _, pct in ipairs({80, 100}) do
        local mark = pct .. unit[i]
        if not string.find(flags, mark, 1, true) then
          newly[#newly + 1] = pct
          flags = flags .. mark .. ','
        end
      end
      if #newly > 0 then redis.call('HSET', key, p[i] .. ':flags', flags) end
      redis.call('PEXPIRE', key, ttl)
    end
    return {0, i, lim[i], spent[i], reserved[i], now, day, month, table.concat(newly, ',')}
  end
end
if mode == 'check' then return {1, 0, 0, 0, 0, now, day, month, ''} end
-- Forget periods older than the previous one (a late settlement of the previous period still finds its fields).
local function roll(name, cur, prefix)
  local old = tonumber(redis.call('HGET', key, name))
  if old == cur then return end
  if old then
    for _, q in ipairs({old - 1, old}) do
      if q < cur - 1 then
        local f = prefix .. q
        redis.call('HDEL', key, f .. ':tok', f .. ':usd', f .. ':rtok', f .. ':rusd', f .. ':flags')
      end
    end
  end
  redis.call('HSET', key, name, cur)
end
roll('day', day, 'd')
roll('month', month, 'm')
redis.call('HINCRBY', key, 'd' .. day .. ':rtok', tok)
redis.call('HINCRBY', key, 'd' .. day .. ':rusd', usd)
redis.call('HINCRBY', key, 'm' .. month .. ':rtok', tok)
redis.call('HINCRBY', key, 'm' .. month .. ':rusd', usd)
redis.call('PEXPIRE', key, ttl)
return {1, 0, 0, 0, 0, now, day, month, ''}
`);

const SETTLE = defineScript(`
-- Settle: a call reserved in (day, month) ended: its reservation goes, its charge is spent.
-- KEYS[1]  the tenant's budget hash
-- ARGV[1] day  ARGV[2] month  ARGV[3] reserved tokens  ARGV[4] reserved nano-USD  ARGV[5] charged tokens
-- ARGV[6] charged nano-USD  ARGV[7..10] the limits (for the 80% and 100% marks)  ARGV[11] the hash's TTL in ms
-- Returns {spent x4, reserved x4, marks}: marks lists the thresholds this settlement crossed first in its period,
-- as 'budget:percent' separated by commas (budget 1..4, percent 80 or 100).
local key = KEYS[1]
local day, month = ARGV[1], ARGV[2]
local rtok, rusd, ctok, cusd = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local lim = {tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])}
local ttl = tonumber(ARGV[11])
local p = {'d' .. day, 'd' .. day, 'm' .. month, 'm' .. month}
local unit = {'tok', 'usd', 'tok', 'usd'}
local held = {rtok, rusd, rtok, rusd}
local charged = {ctok, cusd, ctok, cusd}
local out, marks = {}, {}
for i = 1, 4 do
  -- (0 - x, not -x: Lua writes -0 for a zero, which HINCRBY refuses.)
  local reserved = tonumber(redis.call('HGET', key, p[i] .. ':r' .. unit[i])) or 0
  if held[i] ~= 0 then reserved = redis.call('HINCRBY', key, p[i] .. ':r' .. unit[i], 0 - held[i]) end
  if reserved < 0 then
    -- Its period's fields were forgotten meanwhile (a call across two period ends): nothing is left to release.
    redis.call('HSET', key, p[i] .. ':r' .. unit[i], 0)
    reserved = 0
  end
  local before = tonumber(redis.call('HGET', key, p[i] .. ':' .. unit[i])) or 0
  local spent = before
  if charged[i] > 0 then spent = redis.call('HINCRBY', key, p[i] .. ':' .. unit[i], charged[i]) end
  out[i], out[i + 4] = spent, reserved
  if lim[i] > 0 then
    for _, pct in ipairs({80, 100}) do
      local at = lim[i] * pct / 100
      if before < at and spent >= at then
        local flags = redis.call('HGET', key, p[i] .. ':flags') or ''
        local mark = pct .. unit[i]
        if not string.find(flags, mark, 1, true) then
          redis.call('HSET', key, p[i] .. ':flags', flags .. mark .. ',')
          marks[#marks + 1] = i .. ':' .. pct
        end
      end
    end
  end
end
redis.call('PEXPIRE', key, ttl)
out[9] = table.concat(marks, ',')
return out
`);

const READ_STATE = defineScript(`
-- Read: the current periods' spend and reservations.
-- KEYS[1]  the tenant's budget hash
-- Returns {now ms, day, month, spent x4, reserved x4}.
local key = KEYS[1]
${PERIODS}
${READ}
local _, _, spent, reserved = fields(day, month)
return {now, day, month, spent[1], spent[2], spent[3], spent[4], reserved[1], reserved[2], reserved[3], reserved[4]}
`);

const SEED = defineScript(`
-- Seed: raises the current periods' spend to at least what Postgres recorded (a budget set in the middle of a
-- day counts the day's spend so far).
-- KEYS[1]  the tenant's budget hash
-- ARGV[1..4]  spent by Postgres's record, in the budgets' order   ARGV[5]  the hash's TTL in ms
-- Returns 1.
local key = KEYS[1]
${PERIODS}
local p = {'d' .. day .. ':tok', 'd' .. day .. ':usd', 'm' .. month .. ':tok', 'm' .. month .. ':usd'}
for i = 1, 4 do
  local have = tonumber(redis.call('HGET', key, p[i])) or 0
  local seen = tonumber(ARGV[i])
  if seen > have then redis.call('HSET', key, p[i], seen) end
end
redis.call('HSETNX', key, 'day', day)
redis.call('HSETNX', key, 'month', month)
redis.call('PEXPIRE', key, tonumber(ARGV[5]))
return 1
`);

/** A reservation's answer: held (ok) or refused by the first budget that would pass its limit. */
export interface ReserveReply {
  ok: boolean;
  /** The refusing budget, 0..3 in the budgets' order; -1 when ok. */
  budget: number;
  limit: number;
  spent: number;
  reserved: number;
  /** Redis's clock, epoch ms. */
  now: number;
  day: number;
  month: number;
  /** The marks (80, 100) this refusal is the period's first to reach for that budget. */
  newly: (80 | 100)[];
}

/** Runs the reserve script (mode `reserve`) or its intake question (mode `check`). */
export async function runReserve(
  redis: RedisClient,
  key: string,
  limits: Limits,
  worst: { tokens: number; nanos: number },
  mode: "reserve" | "check",
): Promise<ReserveReply> {
  const r = await RESERVE.run(redis, [key], [
    ...limits,
    worst.tokens,
    worst.nanos,
    BUDGET_STATE_TTL_MS,
    mode,
  ]) as number[];
  return {
    ok: r[0] === 1,
    budget: r[1]! - 1,
    limit: r[2]!,
    spent: r[3]!,
    reserved: r[4]!,
    now: r[5]!,
    day: r[6]!,
    month: r[7]!,
    newly: String(r[8] ?? "").split(",").filter(Boolean).map(Number) as (80 | 100)[],
  };
}

/** A settlement's answer: the periods' spend and reservations after it, and the thresholds it crossed first. */
export interface SettleReply {
  spent: Limits;
  reserved: Limits;
  marks: { budget: number; percent: 80 | 100 }[];
}

/** Runs the settle script. */
export async function runSettle(
  redis: RedisClient,
  key: string,
  at: { day: number; month: number },
  reserved: { tokens: number; nanos: number },
  charged: { tokens: number; nanos: number },
  limits: Limits,
): Promise<SettleReply> {
  const r = await SETTLE.run(redis, [key], [
    at.day,
    at.month,
    reserved.tokens,
    reserved.nanos,
    charged.tokens,
    charged.nanos,
    ...limits,
    BUDGET_STATE_TTL_MS,
  ]) as (number | string)[];
  const marks = String(r[8] ?? "").split(",").filter(Boolean).map((mark) => {
    const [budget, percent] = mark.split(":").map(Number);
    return { budget: budget! - 1, percent: percent as 80 | 100 };
  });
  const n = (i: number) => Number(r[i]);
  return { spent: [n(0), n(1), n(2), n(3)], reserved: [n(4), n(5), n(6), n(7)], marks };
}

/** The current periods' spend and reservations, at Redis's clock. */
export interface BudgetState {
  now: number;
  day: number;
  month: number;
  spent: Limits;
  reserved: Limits;
}

/** Runs the read script. */
export async function readBudgetState(redis: RedisClient, key: string): Promise<BudgetState> {
  const r = (await READ_STATE.run(redis, [key], [])) as number[];
  return {
    now: r[0]!,
    day: r[1]!,
    month: r[2]!,
    spent: [r[3]!, r[4]!, r[5]!, r[6]!],
    reserved: [r[7]!, r[8]!, r[9]!, r[10]!],
  };
}

/** Runs the seed script: the current periods' spend becomes at least `spent`. */
export async function seedBudgetState(redis: RedisClient, key: string, spent: Limits): Promise<void> {
  await SEED.run(redis, [key], [...spent, BUDGET_STATE_TTL_MS]);
}
