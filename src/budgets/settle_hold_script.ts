import type { RedisClient } from "../clients.ts";
import { defineScript } from "../redis/script.ts";
import type { ReplicaAck } from "../redis/replica_ack.ts";
import { type Limits, runOnHash, stateOf, whole } from "./budget_hash.ts";

// SETTLE HOLD: a batch line's hold goes, once, and its charge (the line's reported usage at batch prices; nothing
// for a line that was not answered) is spent in the current day and month.
// KEYS[1]  the tenant's budget hash (its fields: budget_hash.ts).
// ARGV[1]  JSON: {id (the line's run id), charged: {tok, usd}, at (the hold's time as the sweep read it, or -1),
//          limits (for the 80% and 100% marks), lease_ms, ttl_ms, and the caller's periods: day, month,
//          prev_month_first, month_first, next_month_first}.
// With at >= 0 (the sweep), a hold whose time is another (renewed since: a redelivery holding it again, or the
// line just recorded) is left as it is.
// What B:<id> finds decides, and either way leaves nothing for a second run (a resend) to do:
//   held:    the hold goes, the charge is spent;
//   missing: settled already, or never held in this hash (it was lost and rebuilt from Postgres's record, which
//            holds only the lines not yet charged: a line whose model_attempts row is written is in the rebuilt
//            spend instead); nothing is done.
// Answers, writing nothing, {-1} when the hold is missing from a hash without the seeded mark (lost: the caller
// seeds, which holds the line again if it is still in flight, and asks again), {-3, now} when Redis's day is not
// the caller's. Else {applied (1, or 0 when missing), marks (as the settle script's), now ms, then the current
// periods' spend fields and one 'epoch,tokens,nano-USD' per open epoch and 'h,tokens,nano-USD' for the holds, after
// this settlement (budget_hash.ts's stateOf counts them)}.
const SETTLE_HOLD = defineScript(`
local key = KEYS[1]
local a = cjson.decode(ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if math.floor(now / 86400000) ~= a.day then return {-3, now} end
local d, m = 'd' .. a.day, 'm' .. a.month
local found = redis.call('HGET', key, 'B:' .. a.id)
if not found and redis.call('HEXISTS', key, 'seeded') == 0 then return {-1} end
if found and a.at >= 0 and tonumber(string.match(found, '^(%d+)')) ~= a.at then found = nil end
local marks = {}
if found then
  local _, ft, fu = string.match(found, '^(%d+),(%d+),(%d+)')
  redis.call('HDEL', key, 'B:' .. a.id)
  for _, h in ipairs({{'bh:tok', tonumber(ft)}, {'bh:usd', tonumber(fu)}}) do
    if h[2] > 0 and redis.call('HINCRBY', key, h[1], 0 - h[2]) < 0 then redis.call('HSET', key, h[1], 0) end
  end
  local fields = {d .. ':tok', d .. ':usd', m .. ':tok', m .. ':usd'}
  local flags = {d .. ':flags', d .. ':flags', m .. ':flags', m .. ':flags'}
  local unit = {'tok', 'usd', 'tok', 'usd'}
  for i = 1, 4 do
    local charge = a.charged[unit[i]]
    if charge > 0 then
      local before = tonumber(redis.call('HGET', key, fields[i])) or 0
      local after = redis.call('HINCRBY', key, fields[i], charge)
      if a.limits[i] > 0 then
        for _, pct in ipairs({80, 100}) do
          local at = a.limits[i] * pct / 100
          if before < at and after >= at then
            local have = redis.call('HGET', key, flags[i]) or ''
            local mark = pct .. unit[i]
            if not string.find(have, mark, 1, true) then
              redis.call('HSET', key, flags[i], have .. mark .. ',')
              marks[#marks + 1] = i .. ':' .. pct
            end
          end
        end
      end
    end
  end
end
-- A write on a repeat too, so that a WAIT after a resend covers the first run's settlement on this connection.
redis.call('PEXPIRE', key, a.ttl_ms)
local reply = {found and 1 or 0, table.concat(marks, ','), now}
local spent = redis.call('HMGET', key, d .. ':tok', d .. ':usd', m .. ':tok', m .. ':usd', 'bh:tok', 'bh:usd')
for i = 1, 4 do reply[3 + i] = spent[i] end
for open in string.gmatch(redis.call('HGET', key, 'open') or '', '[^,]+') do
  local r = redis.call('HMGET', key, 'r' .. open .. ':tok', 'r' .. open .. ':usd')
  reply[#reply + 1] = open .. ',' .. (r[1] or '0') .. ',' .. (r[2] or '0')
end
reply[#reply + 1] = 'h,' .. (spent[5] or '0') .. ',' .. (spent[6] or '0')
return reply
`);

/** A hold's settlement: the periods' spend and reservations after it, and the thresholds it crossed first. */
export interface SettleHoldReply {
  /** False when the hold was missing (settled already, or never held in this hash): nothing was done. */
  applied: boolean;
  /** The hold was missing and the hash has no seeded mark (it was lost): seed it, then settle again. */
  unseeded: boolean;
  spent: Limits;
  reserved: Limits;
  marks: { budget: number; percent: 80 | 100 }[];
  replicated: boolean;
}

/** Runs the settle-hold script: safe to run twice (see its header). */
export async function runSettleHold(
  redis: RedisClient,
  key: string,
  id: string,
  charged: { tokens: number; nanos: number },
  limits: Limits,
  { ack, at = -1 }: { ack?: ReplicaAck; at?: number } = {},
): Promise<SettleHoldReply> {
  const { reply: r, replicated } = await runOnHash(redis, ack, SETTLE_HOLD, key, {
    id,
    charged: { tok: whole(charged.tokens), usd: whole(charged.nanos) },
    at,
    limits,
  }, { orAlone: true });
  if (Number(r[0]) === -1) {
    return { applied: false, unseeded: true, spent: [0, 0, 0, 0], reserved: [0, 0, 0, 0], marks: [], replicated };
  }
  const [applied, marks, now, ...snapshot] = r;
  const { spent, reserved } = stateOf(Number(now), true, snapshot);
  return {
    applied: Number(applied) === 1,
    unseeded: false,
    spent,
    reserved,
    marks: String(marks ?? "").split(",").filter(Boolean).map((mark) => {
      const [budget, percent] = mark.split(":").map(Number);
      return { budget: budget! - 1, percent: percent as 80 | 100 };
    }),
    replicated,
  };
}
