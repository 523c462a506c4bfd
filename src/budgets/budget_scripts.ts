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
 * Fields: `d<day>:tok|usd` (spent; day = days since the epoch),
 * `m<month>:tok|usd` (month = year * 12 + month - 1), `d<day>:flags` /
 * `m<month>:flags` (thresholds already announced), `day` / `month` (the
 * newest periods seen, for clean-up), and the reservations: per lease epoch
 * of 15 minutes (`r<epoch>:tok|usd`, the epochs listed in `open`; a day and
 * a month are whole epochs, so an epoch's day and month are its own). A
 * reservation settles in its own epoch. One still open an epoch later
 * belongs to a call whose settlement never came (its worker was killed, or
 * Redis refused the settle): it may have been billed, so it is charged as
 * spent to its day and month, and a late settlement corrects it by the
 * difference. A reservation therefore counts as in flight for at most 30
 * minutes.
 *
 * Every reservation has an id (a UUID the worker draws), and only its own
 * settlement removes it, once: `R:<id>` holds a live reservation (`epoch,tokens,nano-USD`), `X:<id>` one that
 * outlived its epoch and was charged whole (a late settlement charges the difference and removes it), `D:<id>` a
 * settlement done in a hash that never held the reservation (it was lost and rebuilt). ioredis resends, after a
 * reconnect, every command whose reply it did not get, and Redis may already have run it: a reserve run twice
 * finds its `R:<id>` and answers as the first did; a settle run twice finds nothing of its id left and does
 * nothing. A reservation reinstated after a loss (see the reinstate script) is `R:<id>` again.
 */
import type { RedisClient } from "../clients.ts";
import { defineScript, type Script } from "../redis/script.ts";
import { NotReplicated, type ReplicaAck } from "../redis/replica_ack.ts";

/** The four budgets' limits: tokens/day, nano-USD/day, tokens/month, nano-USD/month; -1 = none. */
export type Limits = [number, number, number, number];

/** How long a tenant's budget hash outlives its last use: past the previous month. */
export const BUDGET_STATE_TTL_MS = 70 * 24 * 3600 * 1000;

/** A reservation's lease epoch: 15 minutes (a day is 96 of them, so no epoch spans two days or two months). */
export const RESERVATION_EPOCH_MS = 15 * 60_000;

const PRELUDE = `
local LEASE = ${RESERVATION_EPOCH_MS}
-- The civil month of a day number (H. Hinnant's days_from_civil, inverted), as year * 12 + month - 1.
local function month_of(d)
  local z = d + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local mon = mp + 3
  if mp >= 10 then mon = mp - 9 end
  local year = yoe + era * 400
  if mon <= 2 then year = year + 1 end
  return year * 12 + mon - 1
end
local function day_of(e) return math.floor(e * LEASE / 86400000) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local day = math.floor(now / 86400000)
local month = month_of(day)
local epoch = math.floor(now / LEASE)
local unit = {'tok', 'usd', 'tok', 'usd'}
local p = {'d' .. day, 'd' .. day, 'm' .. month, 'm' .. month}
-- HINCRBY by n, never by 0 (nothing to do) nor by -0 (Lua's way of writing a negative zero, which HINCRBY refuses).
local function incr(field, n)
  if n == 0 then return tonumber(redis.call('HGET', key, field)) or 0 end
  if n < 0 then return redis.call('HINCRBY', key, field, 0 - math.abs(n)) end
  return redis.call('HINCRBY', key, field, n)
end
-- The current periods' spend and reservations. Reservations of epochs before the previous one never settled:
-- with write, they are charged as spent to their own day and month (when those are the current or previous
-- ones) and forgotten; without, they are counted as spent in what is returned.
-- Moves the ids of reservations whose epoch was just charged whole (expired[epoch]) from R: to X:, and forgets
-- X: ids older than two days (a settlement later than that leaves the reservation charged) and D: ids older than
-- an hour (a resend comes within seconds). One HGETALL, only when an expired epoch held something unsettled.
local function sweep(expired)
  local all = redis.call('HGETALL', key)
  for i = 1, #all, 2 do
    local f, v = all[i], all[i + 1]
    local kind = string.sub(f, 1, 2)
    if kind == 'R:' or kind == 'X:' or kind == 'D:' then
      local e = tonumber(string.match(v, '^(%d+)')) or 0
      if kind == 'R:' and expired[e] then
        redis.call('HDEL', key, f)
        redis.call('HSET', key, 'X:' .. string.sub(f, 3), v)
      elseif (kind == 'X:' and e < epoch - 192) or (kind == 'D:' and e < epoch - 4) then
        redis.call('HDEL', key, f)
      end
    end
  end
end
local function state(write)
  local list = redis.call('HGET', key, 'open') or ''
  local keep, listed = {}, 0
  local expired, unsettled = {}, false
  local reserved = {0, 0, 0, 0}
  local late = {0, 0, 0, 0}
  for e in string.gmatch(list, '[^,]+') do
    listed = listed + 1
    local n = tonumber(e)
    local h = redis.call('HMGET', key, 'r' .. n .. ':tok', 'r' .. n .. ':usd')
    local amount = {math.max(0, tonumber(h[1]) or 0), math.max(0, tonumber(h[2]) or 0)}
    local ed = day_of(n)
    local em = month_of(ed)
    if n < epoch - 1 then
      for i = 1, 4 do
        local a = amount[(i - 1) % 2 + 1]
        local period = ed
        if i > 2 then period = em end
        local current = day
        if i > 2 then current = month end
        if period == current then late[i] = late[i] + a end
        if write and a > 0 and period >= current - 1 then
          if i <= 2 then incr('d' .. ed .. ':' .. unit[i], a) else incr('m' .. em .. ':' .. unit[i], a) end
        end
      end
      if write then
        redis.call('HDEL', key, 'r' .. n .. ':tok', 'r' .. n .. ':usd')
        expired[n] = true
        if amount[1] > 0 or amount[2] > 0 then unsettled = true end
      end
    else
      keep[#keep + 1] = e
      for i = 1, 4 do
        local a = amount[(i - 1) % 2 + 1]
        if (i <= 2 and ed == day) or (i > 2 and em == month) then reserved[i] = reserved[i] + a end
      end
    end
  end
  if write and #keep ~= listed then redis.call('HSET', key, 'open', table.concat(keep, ',')) end
  if unsettled then sweep(expired) end
  local h = redis.call('HMGET', key, p[1] .. ':tok', p[2] .. ':usd', p[3] .. ':tok', p[4] .. ':usd')
  local spent = {}
  for i = 1, 4 do
    spent[i] = tonumber(h[i]) or 0
    if not write then spent[i] = spent[i] + late[i] end
  end
  return spent, reserved
end
`;

const RESERVE = defineScript(`
-- Reserve (or check): whether a call's worst case fits every budget of the tenant, and in mode reserve, hold it.
-- KEYS[1]  the tenant's budget hash
-- ARGV[1..4]  the limits (tokens/day, nano-USD/day, tokens/month, nano-USD/month; -1 = none)
-- ARGV[5]  the worst case's tokens   ARGV[6]  its nano-USD   ARGV[7]  the hash's TTL in ms
-- ARGV[8]  mode: 'reserve' (counts what is reserved in flight and holds the worst case) or 'check' (an intake's
--          question: would it fit what is spent, reservations aside; writes nothing)
-- ARGV[9]  '1': answer {-1} (and write nothing) when the hash was never seeded from Postgres's record (it was
--          lost: a flush, a failover without persistence, an eviction; or it predates the seeded mark)
-- ARGV[10] the reservation's id (mode reserve): run twice (a resend), the second run finds R:<id> and answers
--          as the first did, holding nothing more
-- ARGV[11] the incarnation the caller's reservations in flight were held in ('' when it has none): when the hash
--          is another one (lost and rebuilt), answer {-2, inc} and write nothing, so the caller holds them in it
--          again (the reinstate script) before anything is decided without them
-- Returns {ok, budget (1..4, the refusing one whose period ends last; 0 when ok), limit, spent, reserved, now ms, day,
-- month, newly (the marks, 80 and/or 100, this refusal is the first of the period to reach, comma-separated),
-- never (1: the worst case alone is over a limit), epoch (the reservation's, when ok), inc (the hash's incarnation,
-- when ok)}.
local key = KEYS[1]
local lim = {tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])}
local tok, usd, ttl, mode, id = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8], ARGV[10] or ''
if ARGV[9] == '1' and redis.call('HEXISTS', key, 'seeded') == 0 then return {-1} end
local expected = ARGV[11] or ''
if expected ~= '' and redis.call('HGET', key, 'inc') ~= expected then return {-2, redis.call('HGET', key, 'inc') or ''} end
${PRELUDE}
if mode == 'reserve' and id ~= '' then
  local held = redis.call('HGET', key, 'R:' .. id)
  if held then
    -- A write, so that a WAIT after this resend covers the first run's reservation on this connection too.
    redis.call('PEXPIRE', key, ttl)
    return {1, 0, 0, 0, 0, now, day, month, '', 0, tonumber(string.match(held, '^(%d+)')), redis.call('HGET', key, 'inc') or ''}
  end
end
local spent, reserved = state(mode == 'reserve')
local want = {tok, usd, tok, usd}
-- The budget that refuses: of those that would pass their limit, the one whose period ends last (a month's
-- after a day's), so Retry-After and the wait name when the call can fit again. never: the worst case alone
-- is over a limit, so no period's end makes it fit.
local refusing, never = 0, 0
for i = 1, 4 do
  local held = reserved[i]
  if mode == 'check' then held = 0 end
  if lim[i] >= 0 and spent[i] + held + want[i] > lim[i] then refusing = i end
  if lim[i] >= 0 and want[i] > lim[i] then never = 1 end
end
if refusing > 0 then
  local i = refusing
  -- Refused: the budget is reached (100%), and so is 80% if spend had not passed it yet (a worst case can be
  -- refused below 80% spent). Each mark once per period; a worst case over the limit itself marks nothing.
  local newly = {}
  if mode == 'reserve' and never == 0 then
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
  return {0, i, lim[i], spent[i], reserved[i], now, day, month, table.concat(newly, ','), never, 0}
end
if mode == 'check' then return {1, 0, 0, 0, 0, now, day, month, '', 0, 0} end
-- Forget periods older than the previous one (a late settlement of the previous period still finds its fields).
local function roll(name, cur, prefix)
  local old = tonumber(redis.call('HGET', key, name))
  if old == cur then return end
  if old then
    for _, q in ipairs({old - 1, old}) do
      if q < cur - 1 then
        local f = prefix .. q
        redis.call('HDEL', key, f .. ':tok', f .. ':usd', f .. ':flags')
      end
    end
  end
  redis.call('HSET', key, name, cur)
end
roll('day', day, 'd')
roll('month', month, 'm')
incr('r' .. epoch .. ':tok', tok)
incr('r' .. epoch .. ':usd', usd)
if id ~= '' then redis.call('HSET', key, 'R:' .. id, epoch .. ',' .. tok .. ',' .. usd) end
local list = redis.call('HGET', key, 'open') or ''
if not string.find(',' .. list .. ',', ',' .. epoch .. ',', 1, true) then
  if list == '' then list = tostring(epoch) else list = list .. ',' .. epoch end
  redis.call('HSET', key, 'open', list)
end
-- The hash's incarnation: a settlement names it, so one of a reservation held in a hash since lost (and rebuilt)
-- is told apart from one charged late in this hash.
local inc = redis.call('HGET', key, 'inc')
if not inc then
  inc = t[1] .. '.' .. t[2]
  redis.call('HSET', key, 'inc', inc)
end
redis.call('PEXPIRE', key, ttl)
return {1, 0, 0, 0, 0, now, day, month, '', 0, epoch, inc}
`);

const SETTLE = defineScript(`
-- Settle: a call's reservation goes, once, and its charge is spent in the reservation's day and month.
-- KEYS[1]  the tenant's budget hash
-- ARGV[1] the reservation's epoch  ARGV[2] reserved tokens  ARGV[3] reserved nano-USD  ARGV[4] charged tokens
-- ARGV[5] charged nano-USD  ARGV[6..9] the limits (for the 80% and 100% marks)  ARGV[10] the hash's TTL in ms
-- ARGV[11] the incarnation the reservation was held in ('' when unknown)  ARGV[12] the reservation's id
-- What the id finds decides, and each way leaves nothing for a second run (a resend) to do:
--   R:<id>  held: the reservation (as the hash recorded it) goes, the charge is spent;
--   X:<id>  charged whole when its epoch ended: only the difference is charged;
--   neither, in another incarnation than the one that held it (that hash was lost, and this one rebuilt from
--   Postgres's record never held it): the whole charge is spent, and D:<id> records that it was;
--   neither otherwise (or D:<id>): already settled, nothing is done.
-- Returns {-1} (nothing written) when the hash has no seeded mark, else {spent x4, reserved x4 (the current
-- periods', after this), marks, applied (1, or 0 for a repeat), the hash's incarnation}: marks
-- lists the thresholds this settlement crossed first in its period, as 'budget:percent' separated by commas
-- (budget 1..4, percent 80 or 100).
local key = KEYS[1]
local e = tonumber(ARGV[1])
local rtok, rusd, ctok, cusd = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local lim = {tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])}
local ttl = tonumber(ARGV[10])
local id = ARGV[12] or ''
-- A hash without the seeded mark was lost (or predates it): a charge spent here now would be overwritten by the
-- seed (which takes the record's spend, where this call is not yet). Nothing is written; the caller seeds first.
if redis.call('HEXISTS', key, 'seeded') == 0 then return {-1} end
${PRELUDE}
local way = 'done'
local found = redis.call('HGET', key, 'R:' .. id)
if found then
  way = 'held'
else
  found = redis.call('HGET', key, 'X:' .. id)
  if found then
    way = 'late'
  elseif redis.call('HEXISTS', key, 'D:' .. id) == 0 and ARGV[11] ~= '' and redis.call('HGET', key, 'inc') ~= ARGV[11] then
    way = 'lost'
  end
end
if found then
  local fe, ft, fu = string.match(found, '^(%d+),(%d+),(%d+)')
  e, rtok, rusd = tonumber(fe), tonumber(ft), tonumber(fu)
end
if way == 'done' then
  -- A write, so that a WAIT after a resend covers the first run's settlement on this connection too.
  redis.call('PEXPIRE', key, ttl)
  local spent, reserved = state(false)
  return {spent[1], spent[2], spent[3], spent[4], reserved[1], reserved[2], reserved[3], reserved[4], '', 0,
    redis.call('HGET', key, 'inc') or ''}
end
local ed = day_of(e)
local em = month_of(ed)
local own = {'d' .. ed, 'd' .. ed, 'm' .. em, 'm' .. em}
local held = {rtok, rusd, rtok, rusd}
local charged = {ctok, cusd, ctok, cusd}
if way == 'held' then
  incr('r' .. e .. ':tok', 0 - rtok)
  incr('r' .. e .. ':usd', 0 - rusd)
  redis.call('HDEL', key, 'R:' .. id)
elseif way == 'late' then
  redis.call('HDEL', key, 'X:' .. id)
else
  redis.call('HSET', key, 'D:' .. id, epoch)
end
local marks = {}
for i = 1, 4 do
  -- Charged whole already when its epoch ended: only the difference is left to charge.
  local charge = charged[i]
  if way == 'late' then charge = charged[i] - held[i] end
  local field = own[i] .. ':' .. unit[i]
  local before = tonumber(redis.call('HGET', key, field)) or 0
  local after = incr(field, charge)
  if after < 0 then
    redis.call('HSET', key, field, 0)
    after = 0
  end
  if lim[i] > 0 and own[i] == p[i] then
    for _, pct in ipairs({80, 100}) do
      local at = lim[i] * pct / 100
      if before < at and after >= at then
        local flags = redis.call('HGET', key, own[i] .. ':flags') or ''
        local mark = pct .. unit[i]
        if not string.find(flags, mark, 1, true) then
          redis.call('HSET', key, own[i] .. ':flags', flags .. mark .. ',')
          marks[#marks + 1] = i .. ':' .. pct
        end
      end
    end
  end
end
redis.call('PEXPIRE', key, ttl)
local spent, reserved = state(false)
return {spent[1], spent[2], spent[3], spent[4], reserved[1], reserved[2], reserved[3], reserved[4], table.concat(marks, ','), 1,
  redis.call('HGET', key, 'inc') or ''}
`);

const REINSTATE = defineScript(`
-- Reinstate: a process's reservations still in flight, held again in a hash that never saw them (the one that did
-- was lost, and this one rebuilt from Postgres's record, which has no calls in flight). Each is added to the
-- current epoch as R:<id> unless this hash knows its id (R:, X:, D:) or holds it already (its incarnation is this
-- hash's): safe to run twice.
-- KEYS[1]  the tenant's budget hash
-- ARGV[1]  JSON: [{"id", "tok", "usd", "inc"}, ...]   ARGV[2]  the hash's TTL in ms
-- Returns {incarnation, how many were added}.
local key = KEYS[1]
${PRELUDE}
local cur = redis.call('HGET', key, 'inc')
if not cur then
  cur = t[1] .. '.' .. t[2]
  redis.call('HSET', key, 'inc', cur)
end
local added = 0
for _, r in ipairs(cjson.decode(ARGV[1])) do
  local known = redis.call('HEXISTS', key, 'R:' .. r.id) == 1 or redis.call('HEXISTS', key, 'X:' .. r.id) == 1 or
    redis.call('HEXISTS', key, 'D:' .. r.id) == 1
  if not known and r.inc ~= cur then
    incr('r' .. epoch .. ':tok', r.tok)
    incr('r' .. epoch .. ':usd', r.usd)
    redis.call('HSET', key, 'R:' .. r.id, epoch .. ',' .. r.tok .. ',' .. r.usd)
    added = added + 1
  end
end
if added > 0 then
  local list = redis.call('HGET', key, 'open') or ''
  if not string.find(',' .. list .. ',', ',' .. epoch .. ',', 1, true) then
    if list == '' then list = tostring(epoch) else list = list .. ',' .. epoch end
    redis.call('HSET', key, 'open', list)
  end
end
redis.call('PEXPIRE', key, tonumber(ARGV[2]))
return {cur, added}
`);

const READ_STATE = defineScript(`
-- Read: the current periods' spend and reservations (reservations that never settled count as spent).
-- KEYS[1]  the tenant's budget hash
-- Returns {now ms, day, month, spent x4, reserved x4, seeded (1 or 0)}.
local key = KEYS[1]
${PRELUDE}
local spent, reserved = state(false)
return {now, day, month, spent[1], spent[2], spent[3], spent[4], reserved[1], reserved[2], reserved[3], reserved[4],
  redis.call('HEXISTS', key, 'seeded')}
`);

const SEED = defineScript(`
-- Seed: raises the current periods' spend to at least what Postgres recorded (a budget set in the middle of a
-- day counts the day's spend so far; a hash lost in Redis is rebuilt), and marks the hash seeded.
-- KEYS[1]  the tenant's budget hash
-- ARGV[1..4]  spent by Postgres's record, in the budgets' order   ARGV[5]  the hash's TTL in ms
-- Returns 1.
local key = KEYS[1]
${PRELUDE}
for i = 1, 4 do
  local field = p[i] .. ':' .. unit[i]
  local have = tonumber(redis.call('HGET', key, field)) or 0
  local seen = tonumber(ARGV[i])
  if seen > have then redis.call('HSET', key, field, seen) end
end
redis.call('HSETNX', key, 'day', day)
redis.call('HSETNX', key, 'month', month)
redis.call('HSET', key, 'seeded', 1)
redis.call('HSETNX', key, 'inc', t[1] .. '.' .. t[2])
redis.call('PEXPIRE', key, tonumber(ARGV[5]))
return 1
`);

/**
 * A whole, non-negative number for a script: HINCRBY refuses anything else, and Redis does not undo a script's
 * earlier writes when a later command fails.
 */
function whole(n: number): number {
  return Number.isFinite(n) ? Math.max(0, Math.ceil(n)) : 0;
}

/**
 * Runs a script on `redis`, or with `ack` (REDIS_MIN_REPLICAS_ACK) followed by a WAIT in the same round trip:
 * then `replicated` says whether enough replicas have its writes.
 */
async function exec(
  redis: RedisClient,
  ack: ReplicaAck | undefined,
  script: Script,
  keys: string[],
  args: (string | number)[],
  { orAlone = false }: { orAlone?: boolean } = {},
): Promise<{ result: unknown; replicated: boolean }> {
  if (!ack) return { result: await script.run(redis, keys, args), replicated: true };
  try {
    const { result, replicated } = await ack.run(script, keys, args);
    return { result, replicated };
  } catch (error) {
    // No connection came free to wait on (nothing ran): with `orAlone`, run without the WAIT rather than not at all.
    if (!orAlone || !(error instanceof NotReplicated) || error.details.ran) throw error;
    return { result: await script.run(redis, keys, args), replicated: false };
  }
}

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
  /** The worst case alone is over a limit: no period's end makes it fit (only a raised budget). */
  never: boolean;
  /** The reservation's lease epoch (when ok): its settlement names it. */
  epoch: number;
  /** Asked with `requireSeeded`, the hash was never seeded: nothing was decided or written. */
  unseeded: boolean;
  /** The hash's incarnation (when ok): the settlement names it. */
  inc: string;
  /** The reservation's id (mode reserve): only its own settlement removes it, once. */
  id: string;
  /** Asked with `expectInc`, the hash is another incarnation (this one, '' if none): nothing was decided. */
  otherInc?: string;
  /** With a replica acknowledgement: whether enough replicas have what the script wrote (true without one). */
  replicated: boolean;
}

/** Runs the reserve script (mode `reserve`) or its intake question (mode `check`). */
export async function runReserve(
  redis: RedisClient,
  key: string,
  limits: Limits,
  worst: { tokens: number; nanos: number },
  mode: "reserve" | "check",
  { requireSeeded = false, id = mode === "reserve" ? crypto.randomUUID() : "", expectInc = "", ack }: {
    requireSeeded?: boolean;
    /** The incarnation the caller's calls in flight were reserved in: another one answers `otherInc`. */
    expectInc?: string;
    /** The reservation's id; a new one unless given (a caller asking again after a failure passes the same). */
    id?: string;
    ack?: ReplicaAck;
  } = {},
): Promise<ReserveReply> {
  const { result, replicated } = await exec(redis, mode === "reserve" ? ack : undefined, RESERVE, [key], [
    ...limits,
    whole(worst.tokens),
    whole(worst.nanos),
    BUDGET_STATE_TTL_MS,
    mode,
    requireSeeded ? "1" : "0",
    id,
    expectInc,
  ]);
  const r = result as (number | string)[];
  const n = (i: number) => Number(r[i]);
  if (n(0) === -1 || n(0) === -2) {
    return {
      ok: false,
      budget: -1,
      limit: 0,
      spent: 0,
      reserved: 0,
      now: 0,
      day: 0,
      month: 0,
      newly: [],
      never: false,
      epoch: 0,
      unseeded: n(0) === -1,
      otherInc: n(0) === -2 ? String(r[1] ?? "") : undefined,
      inc: "",
      id,
      replicated,
    };
  }
  return {
    ok: n(0) === 1,
    budget: n(1) - 1,
    limit: n(2),
    spent: n(3),
    reserved: n(4),
    now: n(5),
    day: n(6),
    month: n(7),
    newly: String(r[8] ?? "").split(",").filter(Boolean).map(Number) as (80 | 100)[],
    never: n(9) === 1,
    epoch: n(10),
    unseeded: false,
    inc: String(r[11] ?? ""),
    id,
    replicated,
  };
}

/** A settlement's answer: the periods' spend and reservations after it, and the thresholds it crossed first. */
export interface SettleReply {
  spent: Limits;
  reserved: Limits;
  marks: { budget: number; percent: 80 | 100 }[];
  /** False when the reservation was settled already (this was a repeat, and did nothing). */
  applied: boolean;
  /** The hash's incarnation now. */
  inc: string;
  /** The hash has no seeded mark (it was lost): nothing was done; seed it, then settle again. */
  unseeded: boolean;
  /** With a replica acknowledgement: whether enough replicas have the settlement (true without one). */
  replicated: boolean;
}

/** Runs the settle script: safe to run twice (see its header). */
export async function runSettle(
  redis: RedisClient,
  key: string,
  at: { epoch: number; inc?: string; id: string },
  reserved: { tokens: number; nanos: number },
  charged: { tokens: number; nanos: number },
  limits: Limits,
  { ack }: { ack?: ReplicaAck } = {},
): Promise<SettleReply> {
  const { result, replicated } = await exec(redis, ack, SETTLE, [key], [
    at.epoch,
    whole(reserved.tokens),
    whole(reserved.nanos),
    whole(charged.tokens),
    whole(charged.nanos),
    ...limits,
    BUDGET_STATE_TTL_MS,
    at.inc ?? "",
    at.id,
  ], { orAlone: true });
  const r = result as (number | string)[];
  const n = (i: number) => Number(r[i]);
  if (n(0) === -1 && r.length === 1) {
    return {
      spent: [0, 0, 0, 0],
      reserved: [0, 0, 0, 0],
      marks: [],
      applied: false,
      inc: "",
      unseeded: true,
      replicated,
    };
  }
  const marks = String(r[8] ?? "").split(",").filter(Boolean).map((mark) => {
    const [budget, percent] = mark.split(":").map(Number);
    return { budget: budget! - 1, percent: percent as 80 | 100 };
  });
  return {
    spent: [n(0), n(1), n(2), n(3)],
    reserved: [n(4), n(5), n(6), n(7)],
    marks,
    applied: n(9) === 1,
    inc: String(r[10] ?? ""),
    unseeded: false,
    replicated,
  };
}

/** A reservation a process holds for a call in flight, as the reinstate script takes it. */
export interface InFlight {
  id: string;
  tok: number;
  usd: number;
  /** The incarnation of the hash that held it. */
  inc: string;
}

/** Runs the reinstate script: holds `inFlight` again in a hash that never held them. @returns the hash's incarnation. */
export async function reinstateReservations(
  redis: RedisClient,
  key: string,
  inFlight: InFlight[],
  { ack }: { ack?: ReplicaAck } = {},
): Promise<{ inc: string; added: number }> {
  const { result } = await exec(redis, ack, REINSTATE, [key], [JSON.stringify(inFlight), BUDGET_STATE_TTL_MS]);
  const [inc, added] = result as [string, number];
  return { inc: String(inc), added: Number(added) };
}

/** The current periods' spend and reservations, at Redis's clock. */
export interface BudgetState {
  now: number;
  day: number;
  month: number;
  spent: Limits;
  reserved: Limits;
  /** The hash was seeded from Postgres's record (see the seed script); false when it was lost, or never made. */
  seeded: boolean;
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
    seeded: r[11] === 1,
  };
}

/** Runs the seed script: the current periods' spend becomes at least `spent`. */
export async function seedBudgetState(redis: RedisClient, key: string, spent: Limits): Promise<void> {
  await SEED.run(redis, [key], [...spent, BUDGET_STATE_TTL_MS]);
}
