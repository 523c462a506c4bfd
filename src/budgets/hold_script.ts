import type { RedisClient } from "../clients.ts";
import { defineScript } from "../redis/script.ts";
import type { ReplicaAck } from "../redis/replica_ack.ts";
import { type Limits, runOnHash, whole } from "./budget_hash.ts";

// HOLD: whether a batch line's worst case fits every budget of the tenant, and if it does, hold it until the line
// is settled (issue 43). A hold is not a call's reservation: a provider batch may take a day, so it belongs to no
// lease epoch and is never charged whole for being old; it goes when its line settles (the settle-hold script)
// and counts, meanwhile, against the current day and month, whichever they are.
// KEYS[1]  the tenant's budget hash (its fields: budget_hash.ts).
// ARGV[1]  JSON: {limits: [tokens/day, nano-USD/day, tokens/month, nano-USD/month] (-1 = none), tok, usd (the
//          worst case at batch prices), id (the line's run id), keep (true: the line is recorded, hold it whether it
//          fits or not), lease_ms, ttl_ms, and the caller's periods: day, month, prev_month_first, month_first,
//          next_month_first (budget_hash.ts's periodsAt)}.
// With keep, a line just recorded in Postgres is held again if the hash lost its hold (a rebuild whose snapshot
// came before the record's commit, or the sweep, which found no line yet): it is in flight and will be charged, so
// it counts, fit or not.
// Answers, writing nothing, {-1} when the hash was never seeded from Postgres's record, {-3, now} when Redis's day
// is not the caller's. Else {ok, budget (1..4, the refusing one whose period ends last; 0 when ok), limit, spent,
// reserved (calls in flight and holds), now ms, never (1: the worst case alone is over a limit)}.
// Safe to run twice: a second run (a resend, a redelivery of the run) finds B:<id> and answers ok, holding nothing
// more; it renews the hold's time, so the sweep (which settles a hold only at the time it read) leaves it.
const HOLD = defineScript(`
local key = KEYS[1]
local a = cjson.decode(ARGV[1])
if redis.call('HEXISTS', key, 'seeded') == 0 then return {-1} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local day, month, epoch = math.floor(now / 86400000), a.month, math.floor(now / a.lease_ms)
if day ~= a.day then return {-3, now} end
local found = redis.call('HGET', key, 'B:' .. a.id)
if found then
  -- Renewed (a write, so that a WAIT after this resend covers the first run's hold on this connection too).
  local _, ft, fu = string.match(found, '^(%d+),(%d+),(%d+)')
  redis.call('HSET', key, 'B:' .. a.id, now .. ',' .. ft .. ',' .. fu)
  redis.call('PEXPIRE', key, a.ttl_ms)
  return {1, 0, 0, 0, 0, now, 0}
end
if a.keep then
  redis.call('HSET', key, 'B:' .. a.id, now .. ',' .. a.tok .. ',' .. a.usd)
  if a.tok > 0 then redis.call('HINCRBY', key, 'bh:tok', a.tok) end
  if a.usd > 0 then redis.call('HINCRBY', key, 'bh:usd', a.usd) end
  redis.call('PEXPIRE', key, a.ttl_ms)
  return {1, 0, 0, 0, 0, now, 0}
end
local function month_of(d)
  if d >= a.next_month_first then return month + 1 end
  if d >= a.month_first then return month end
  if d >= a.prev_month_first then return month - 1 end
end
local cur = {day, day, month, month}
local s = redis.call('HMGET', key, 'd' .. day .. ':tok', 'd' .. day .. ':usd', 'm' .. month .. ':tok',
  'm' .. month .. ':usd', 'bh:tok', 'bh:usd')
local spent, reserved = {}, {}
for i = 1, 4 do
  spent[i] = tonumber(s[i]) or 0
  reserved[i] = math.max(0, tonumber(s[5 + (i - 1) % 2]) or 0)
end
-- Calls' reservations as the read script counts them: in flight for two epochs, spent (not yet written) after.
for e in string.gmatch(redis.call('HGET', key, 'open') or '', '[^,]+') do
  local n = tonumber(e)
  local h = redis.call('HMGET', key, 'r' .. n .. ':tok', 'r' .. n .. ':usd')
  local ed = math.floor(n * a.lease_ms / 86400000)
  local own = {ed, ed, month_of(ed), month_of(ed)}
  for i = 1, 4 do
    local x = math.max(0, tonumber(h[(i - 1) % 2 + 1]) or 0)
    if own[i] == cur[i] then
      if n >= epoch - 1 then reserved[i] = reserved[i] + x else spent[i] = spent[i] + x end
    end
  end
end
local lim, want = a.limits, {a.tok, a.usd, a.tok, a.usd}
local refusing, never = 0, 0
for i = 1, 4 do
  if lim[i] >= 0 and spent[i] + reserved[i] + want[i] > lim[i] then refusing = i end
  if lim[i] >= 0 and want[i] > lim[i] then never = 1 end
end
if refusing > 0 then
  local i = refusing
  return {0, i, lim[i], spent[i], reserved[i], now, never}
end
redis.call('HSET', key, 'B:' .. a.id, now .. ',' .. a.tok .. ',' .. a.usd)
if a.tok > 0 then redis.call('HINCRBY', key, 'bh:tok', a.tok) end
if a.usd > 0 then redis.call('HINCRBY', key, 'bh:usd', a.usd) end
redis.call('PEXPIRE', key, a.ttl_ms)
return {1, 0, 0, 0, 0, now, 0}
`);

/** A hold's answer: held (ok), or refused by the first budget the worst case would pass. */
export interface HoldReply {
  ok: boolean;
  /** The refusing budget, 0..3 in the budgets' order; -1 when ok. */
  budget: number;
  limit: number;
  spent: number;
  reserved: number;
  /** Redis's clock, epoch ms. */
  now: number;
  /** The worst case alone is over a limit. */
  never: boolean;
  /** The hash was never seeded: nothing was decided or written. */
  unseeded: boolean;
  /** With a replica acknowledgement: whether enough replicas have what the script wrote (true without one). */
  replicated: boolean;
}

/**
 * Runs the hold script: holds `worst` for the line `id` against `limits` if it fits (with `keep`, whether it fits
 * or not). Safe to run twice.
 */
export async function runHold(
  redis: RedisClient,
  key: string,
  limits: Limits,
  worst: { tokens: number; nanos: number },
  { id, keep = false, ack }: { id: string; keep?: boolean; ack?: ReplicaAck },
): Promise<HoldReply> {
  const { reply: r, replicated } = await runOnHash(redis, ack, HOLD, key, {
    limits,
    tok: whole(worst.tokens),
    usd: whole(worst.nanos),
    id,
    keep,
  });
  const n = (i: number) => Number(r[i] ?? 0);
  if (n(0) === -1) {
    return { ok: false, budget: -1, limit: 0, spent: 0, reserved: 0, now: 0, never: false, unseeded: true, replicated };
  }
  return {
    ok: n(0) === 1,
    budget: n(1) - 1,
    limit: n(2),
    spent: n(3),
    reserved: n(4),
    now: n(5),
    never: n(6) === 1,
    unseeded: false,
    replicated,
  };
}

/** A batch line's hold as its tenant's hash records it. */
export interface HeldLine {
  id: string;
  /** When it was held, by Redis's clock (epoch ms). */
  atMs: number;
  tokens: number;
  nanos: number;
}

/** The holds in a tenant's budget hash: none without a sum of holds (one HMGET), else one HSCAN of its `B:` fields. */
export async function heldIn(redis: RedisClient, key: string): Promise<HeldLine[]> {
  const [tok, usd] = await redis.hmget(key, "bh:tok", "bh:usd");
  if (!(Number(tok) > 0 || Number(usd) > 0)) return [];
  const held: HeldLine[] = [];
  let cursor = "0";
  do {
    const [next, entries] = await redis.hscan(key, cursor, "MATCH", "B:*", "COUNT", 500);
    for (let i = 0; i + 1 < entries.length; i += 2) {
      const [at = 0, tokens = 0, nanos = 0] = String(entries[i + 1]).split(",").map(Number);
      held.push({ id: String(entries[i]).slice(2), atMs: at, tokens, nanos });
    }
    cursor = String(next);
  } while (cursor !== "0");
  return held;
}
