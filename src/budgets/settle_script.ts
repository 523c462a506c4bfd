import type { RedisClient } from "../clients.ts";
import { defineScript } from "../redis/script.ts";
import type { ReplicaAck } from "../redis/replica_ack.ts";
import { type Limits, runOnHash, stateOf, whole } from "./budget_hash.ts";

// SETTLE: a call's reservation goes, once, and its charge is spent in the reservation's day and month.
// KEYS[1]  the tenant's budget hash (its fields: budget_hash.ts).
// ARGV[1]  JSON: {id (the reservation's), epoch (its lease epoch), inc (the incarnation it was held in, '' when
//          unknown), reserved: {tok, usd}, charged: {tok, usd}, limits (for the 80% and 100% marks), lease_ms, ttl_ms,
//          and the caller's periods: day, month, prev_month_first, month_first, next_month_first}.
// What the id finds decides, and each way leaves nothing for a second run (a resend) to do:
//   R:<id>  held: the reservation (as the hash recorded it) goes, the charge is spent;
//   X:<id>  charged whole when its epoch ended: only the difference is charged;
//   neither, in another incarnation than the one that held it (that hash was lost, and this one rebuilt from
//   Postgres's record never held it): the whole charge is spent, and D:<id> records that it was;
//   neither otherwise (or D:<id>): already settled, nothing is done.
// Answers, writing nothing, {-1} when the hash has no seeded mark, {-3, now} when Redis's day is not the caller's.
// Else {applied (1, or 0 for a repeat), marks, the hash's incarnation, now ms, then the current periods' spend fields
// (tokens/day, nano-USD/day, tokens/month, nano-USD/month), one 'epoch,tokens,nano-USD' per open epoch and
// 'h,tokens,nano-USD' for the batch lines' holds, if any, after
// this settlement (budget_hash.ts's stateOf counts them)}: marks lists the thresholds this settlement crossed first
// in its period, as 'budget:percent' separated by commas (budget 1..4, percent 80 or 100).
const SETTLE = defineScript(`
local key = KEYS[1]
local a = cjson.decode(ARGV[1])
-- A hash without the seeded mark was lost (or predates it): a charge spent here now would be overwritten by the
-- seed (which takes the record's spend, where this call is not yet). Nothing is written; the caller seeds first.
if redis.call('HEXISTS', key, 'seeded') == 0 then return {-1} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if math.floor(now / 86400000) ~= a.day then return {-3, now} end
local d, m = 'd' .. a.day, 'm' .. a.month
local id, e, held = a.id, a.epoch, {a.reserved.tok, a.reserved.usd}
local way = 'done'
local found = redis.call('HGET', key, 'R:' .. id)
if found then
  way = 'held'
else
  found = redis.call('HGET', key, 'X:' .. id)
  if found then
    way = 'late'
  elseif redis.call('HEXISTS', key, 'D:' .. id) == 0 and a.inc ~= '' and redis.call('HGET', key, 'inc') ~= a.inc then
    way = 'lost'
  end
end
if found then
  local fe, ft, fu = string.match(found, '^(%d+),(%d+),(%d+)')
  e, held = tonumber(fe), {tonumber(ft), tonumber(fu)}
end
-- HINCRBY by n, never by 0 (nothing to do) nor by -0 (Lua's way of writing a negative zero, which HINCRBY refuses).
local function incr(field, n)
  if n == 0 then return tonumber(redis.call('HGET', key, field)) or 0 end
  if n < 0 then return redis.call('HINCRBY', key, field, 0 - math.abs(n)) end
  return redis.call('HINCRBY', key, field, n)
end
local marks = {}
if way ~= 'done' then
  if way == 'held' then
    incr('r' .. e .. ':tok', 0 - held[1])
    incr('r' .. e .. ':usd', 0 - held[2])
    redis.call('HDEL', key, 'R:' .. id)
  elseif way == 'late' then
    redis.call('HDEL', key, 'X:' .. id)
  else
    redis.call('HSET', key, 'D:' .. id, math.floor(now / a.lease_ms))
  end
  -- The reservation's own day and month (by the caller's calendar: no month before the previous one is named).
  local ed = math.floor(e * a.lease_ms / 86400000)
  local em = ed >= a.next_month_first and a.month + 1 or ed >= a.month_first and a.month or
    ed >= a.prev_month_first and a.month - 1 or nil
  local own = {'d' .. ed, 'd' .. ed, em and 'm' .. em, em and 'm' .. em}
  local current = {d, d, m, m}
  local unit = {'tok', 'usd', 'tok', 'usd'}
  for i = 1, 4 do
    -- Charged whole already when its epoch ended: only the difference is left to charge.
    local charge = a.charged[unit[i]]
    if way == 'late' then charge = charge - held[(i - 1) % 2 + 1] end
    local field = own[i] and own[i] .. ':' .. unit[i]
    local before = field and tonumber(redis.call('HGET', key, field)) or 0
    local after = field and incr(field, charge) or 0
    if after < 0 then
      redis.call('HSET', key, field, 0)
      after = 0
    end
    if a.limits[i] > 0 and own[i] == current[i] then
      for _, pct in ipairs({80, 100}) do
        local at = a.limits[i] * pct / 100
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
end
-- A write on a repeat too, so that a WAIT after a resend covers the first run's settlement on this connection.
redis.call('PEXPIRE', key, a.ttl_ms)
local reply = {way == 'done' and 0 or 1, table.concat(marks, ','), redis.call('HGET', key, 'inc') or '', now}
local spent = redis.call('HMGET', key, d .. ':tok', d .. ':usd', m .. ':tok', m .. ':usd')
for i = 1, 4 do reply[4 + i] = spent[i] end
for open in string.gmatch(redis.call('HGET', key, 'open') or '', '[^,]+') do
  local r = redis.call('HMGET', key, 'r' .. open .. ':tok', 'r' .. open .. ':usd')
  reply[#reply + 1] = open .. ',' .. (r[1] or '0') .. ',' .. (r[2] or '0')
end
local holds = redis.call('HMGET', key, 'bh:tok', 'bh:usd')
if holds[1] or holds[2] then reply[#reply + 1] = 'h,' .. (holds[1] or '0') .. ',' .. (holds[2] or '0') end
return reply
`);

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
  const { reply: r, replicated } = await runOnHash(redis, ack, SETTLE, key, {
    id: at.id,
    epoch: at.epoch,
    inc: at.inc ?? "",
    reserved: { tok: whole(reserved.tokens), usd: whole(reserved.nanos) },
    charged: { tok: whole(charged.tokens), usd: whole(charged.nanos) },
    limits,
  }, { orAlone: true });
  if (Number(r[0]) === -1) {
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
  const [applied, marks, inc, now, ...snapshot] = r;
  const { spent, reserved: held } = stateOf(Number(now), true, snapshot);
  return {
    spent,
    reserved: held,
    marks: String(marks ?? "").split(",").filter(Boolean).map((mark) => {
      const [budget, percent] = mark.split(":").map(Number);
      return { budget: budget! - 1, percent: percent as 80 | 100 };
    }),
    applied: Number(applied) === 1,
    inc: String(inc ?? ""),
    unseeded: false,
    replicated,
  };
}
