import type { RedisClient } from "../clients.ts";
import { defineScript } from "../redis/script.ts";
import type { ReplicaAck } from "../redis/replica_ack.ts";
import { type Limits, runOnHash, whole } from "./budget_hash.ts";

// RESERVE: whether a call's worst case fits every budget of the tenant, and if it does, hold it as a reservation.
// KEYS[1]  the tenant's budget hash (its fields: budget_hash.ts).
// ARGV[1]  JSON: {limits: [tokens/day, nano-USD/day, tokens/month, nano-USD/month] (-1 = none), tok, usd (the
//          worst case), id (the reservation's), inc (the incarnation the caller's reservations in flight were held
//          in, '' when it has none), require_seeded, lease_ms, ttl_ms, and the caller's periods: day, month,
//          prev_month_first, month_first, next_month_first (budget_hash.ts's periodsAt)}.
// Answers, writing nothing, {-1} with require_seeded when the hash was never seeded from Postgres's record (it was
// lost: a flush, a failover without persistence, an eviction; or it predates the seeded mark); {-2, inc} when inc
// is not '' and the hash is another incarnation (lost and rebuilt), so the caller holds its reservations in it
// again (the reinstate script) before anything is decided without them; {-3, now} when Redis's day is not the
// caller's. Else {ok, budget (1..4, the refusing one whose period ends last; 0 when ok), limit, spent, reserved,
// now ms, day, month, newly (the marks, 80 and/or 100, this refusal is the first of the period to reach,
// comma-separated), never (1: the worst case alone is over a limit), epoch (the reservation's, when ok), inc (the
// hash's incarnation, when ok)}.
// Safe to run twice: a second run (a resend) finds R:<id> and answers as the first did, holding nothing more.
const RESERVE = defineScript(`
local key = KEYS[1]
local a = cjson.decode(ARGV[1])
if a.require_seeded and redis.call('HEXISTS', key, 'seeded') == 0 then return {-1} end
local inc = redis.call('HGET', key, 'inc')
if a.inc ~= '' and inc ~= a.inc then return {-2, inc or ''} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local day, month, epoch = math.floor(now / 86400000), a.month, math.floor(now / a.lease_ms)
if day ~= a.day then return {-3, now} end
local held = redis.call('HGET', key, 'R:' .. a.id)
if held then
  -- A write, so that a WAIT after this resend covers the first run's reservation on this connection too.
  redis.call('PEXPIRE', key, a.ttl_ms)
  return {1, 0, 0, 0, 0, now, day, month, '', 0, tonumber(string.match(held, '^(%d+)')), inc or ''}
end
-- The month of a day from the previous month's first on (nil before), by the caller's calendar.
local function month_of(d)
  if d >= a.next_month_first then return month + 1 end
  if d >= a.month_first then return month end
  if d >= a.prev_month_first then return month - 1 end
end
local kind, unit, cur = {'d', 'd', 'm', 'm'}, {'tok', 'usd', 'tok', 'usd'}, {day, day, month, month}
-- Epochs before the previous one hold reservations whose settlement never came: charged as spent to their own day
-- and month (when those are the current or previous ones) and forgotten. The others are in flight.
local list = redis.call('HGET', key, 'open') or ''
local keep, listed, expired, unsettled = {}, 0, {}, false
local reserved = {0, 0, 0, 0}
for e in string.gmatch(list, '[^,]+') do
  listed = listed + 1
  local n = tonumber(e)
  local h = redis.call('HMGET', key, 'r' .. n .. ':tok', 'r' .. n .. ':usd')
  local amount = {math.max(0, tonumber(h[1]) or 0), math.max(0, tonumber(h[2]) or 0)}
  local ed = math.floor(n * a.lease_ms / 86400000)
  local own = {ed, ed, month_of(ed), month_of(ed)}
  for i = 1, 4 do
    local x = amount[(i - 1) % 2 + 1]
    if n >= epoch - 1 then
      if own[i] == cur[i] then reserved[i] = reserved[i] + x end
    elseif x > 0 and own[i] and own[i] >= cur[i] - 1 then
      redis.call('HINCRBY', key, kind[i] .. own[i] .. ':' .. unit[i], x)
    end
  end
  if n < epoch - 1 then
    redis.call('HDEL', key, 'r' .. n .. ':tok', 'r' .. n .. ':usd')
    expired[n] = true
    if amount[1] > 0 or amount[2] > 0 then unsettled = true end
  else
    keep[#keep + 1] = e
  end
end
if #keep ~= listed then redis.call('HSET', key, 'open', table.concat(keep, ',')) end
-- The ids of reservations just charged whole move from R: to X: (a late settlement charges the difference); X: ids
-- older than two days (a settlement later than that leaves the reservation charged) and D: ids older than an hour
-- (a resend comes within seconds) are forgotten. One HGETALL, only when an expired epoch held something unsettled.
if unsettled then
  local all = redis.call('HGETALL', key)
  for i = 1, #all, 2 do
    local f, v = all[i], all[i + 1]
    local prefix = string.sub(f, 1, 2)
    if prefix == 'R:' or prefix == 'X:' or prefix == 'D:' then
      local e = tonumber(string.match(v, '^(%d+)')) or 0
      if prefix == 'R:' and expired[e] then
        redis.call('HDEL', key, f)
        redis.call('HSET', key, 'X:' .. string.sub(f, 3), v)
      elseif (prefix == 'X:' and e < epoch - 192) or (prefix == 'D:' and e < epoch - 4) then
        redis.call('HDEL', key, f)
      end
    end
  end
end
local s = redis.call('HMGET', key, 'd' .. day .. ':tok', 'd' .. day .. ':usd', 'm' .. month .. ':tok',
  'm' .. month .. ':usd', 'bh:tok', 'bh:usd')
-- Batch lines' holds (hold_script.ts) count against whichever day and month are current.
for i = 1, 4 do reserved[i] = reserved[i] + math.max(0, tonumber(s[5 + (i - 1) % 2]) or 0) end
local lim, want, spent = a.limits, {a.tok, a.usd, a.tok, a.usd}, {}
-- The budget that refuses: of those that would pass their limit, the one whose period ends last (a month's after a
-- day's), so Retry-After and the wait name when the call can fit again. never: the worst case alone is over a
-- limit, so no period's end makes it fit.
local refusing, never = 0, 0
for i = 1, 4 do
  spent[i] = tonumber(s[i]) or 0
  if lim[i] >= 0 and spent[i] + reserved[i] + want[i] > lim[i] then refusing = i end
  if lim[i] >= 0 and want[i] > lim[i] then never = 1 end
end
if refusing > 0 then
  local i = refusing
  -- Refused: the budget is reached (100%), and so is 80% if spend had not passed it yet (a worst case can be
  -- refused below 80% spent). Each mark once per period; a worst case over the limit itself marks nothing.
  local newly = {}
  if never == 0 then
    local field = kind[i] .. cur[i] .. ':flags'
    local flags = redis.call('HGET', key, field) or ''
    for _, pct in ipairs({80, 100}) do
      local mark = pct .. unit[i]
      if not string.find(flags, mark, 1, true) then
        newly[#newly + 1] = pct
        flags = flags .. mark .. ','
      end
    end
    if #newly > 0 then redis.call('HSET', key, field, flags) end
    redis.call('PEXPIRE', key, a.ttl_ms)
  end
  return {0, i, lim[i], spent[i], reserved[i], now, day, month, table.concat(newly, ','), never, 0}
end
-- Forget periods older than the previous one (a late settlement of the previous period still finds its fields).
for _, period in ipairs({{'day', day, 'd'}, {'month', month, 'm'}}) do
  local name, current, prefix = period[1], period[2], period[3]
  local old = tonumber(redis.call('HGET', key, name))
  if old ~= current then
    for _, q in ipairs(old and {old - 1, old} or {}) do
      if q < current - 1 then
        redis.call('HDEL', key, prefix .. q .. ':tok', prefix .. q .. ':usd', prefix .. q .. ':flags')
      end
    end
    redis.call('HSET', key, name, current)
  end
end
if a.tok > 0 then redis.call('HINCRBY', key, 'r' .. epoch .. ':tok', a.tok) end
if a.usd > 0 then redis.call('HINCRBY', key, 'r' .. epoch .. ':usd', a.usd) end
redis.call('HSET', key, 'R:' .. a.id, epoch .. ',' .. a.tok .. ',' .. a.usd)
list = redis.call('HGET', key, 'open') or ''
if not string.find(',' .. list .. ',', ',' .. epoch .. ',', 1, true) then
  if list == '' then list = tostring(epoch) else list = list .. ',' .. epoch end
  redis.call('HSET', key, 'open', list)
end
-- The hash's incarnation: a settlement names it, so one of a reservation held in a hash since lost (and rebuilt)
-- is told apart from one charged late in this hash.
if not inc then
  inc = t[1] .. '.' .. t[2]
  redis.call('HSET', key, 'inc', inc)
end
redis.call('PEXPIRE', key, a.ttl_ms)
return {1, 0, 0, 0, 0, now, day, month, '', 0, epoch, inc}
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
  /** The worst case alone is over a limit: no period's end makes it fit (only a raised budget). */
  never: boolean;
  /** The reservation's lease epoch (when ok): its settlement names it. */
  epoch: number;
  /** Asked with `requireSeeded`, the hash was never seeded: nothing was decided or written. */
  unseeded: boolean;
  /** The hash's incarnation (when ok): the settlement names it. */
  inc: string;
  /** The reservation's id: only its own settlement removes it, once. */
  id: string;
  /** Asked with `expectInc`, the hash is another incarnation (this one, '' if none): nothing was decided. */
  otherInc?: string;
  /** With a replica acknowledgement: whether enough replicas have what the script wrote (true without one). */
  replicated: boolean;
}

/** Runs the reserve script: holds `worst` against `limits` if it fits. Safe to run twice with the same `id`. */
export async function runReserve(
  redis: RedisClient,
  key: string,
  limits: Limits,
  worst: { tokens: number; nanos: number },
  { requireSeeded = false, id = crypto.randomUUID(), expectInc = "", ack }: {
    requireSeeded?: boolean;
    /** The incarnation the caller's calls in flight were reserved in: another one answers `otherInc`. */
    expectInc?: string;
    /** The reservation's id; a new one unless given (a caller asking again after a failure passes the same). */
    id?: string;
    ack?: ReplicaAck;
  } = {},
): Promise<ReserveReply> {
  const { reply: r, replicated } = await runOnHash(redis, ack, RESERVE, key, {
    limits,
    tok: whole(worst.tokens),
    usd: whole(worst.nanos),
    id,
    inc: expectInc,
    require_seeded: requireSeeded,
  });
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
