import type { RedisClient } from "../clients.ts";
import { defineScript } from "../redis/script.ts";
import type { ReplicaAck } from "../redis/replica_ack.ts";
import { runOnHash, whole } from "./budget_hash.ts";

// REINSTATE: a process's reservations still in flight, held again in a hash that never saw them (the one that did
// was lost, and this one rebuilt from Postgres's record, which has no calls in flight). Each is added to the
// current epoch as R:<id> unless this hash knows its id (R:, X:, D:) or holds it already (its incarnation is this
// hash's).
// KEYS[1]  the tenant's budget hash (its fields: budget_hash.ts).
// ARGV[1]  JSON: {reservations: [{id, tok, usd, inc}, ...], lease_ms, ttl_ms} (the caller's periods are not read).
// Returns {incarnation, how many were added}.
// Safe to run twice: the second run knows every id the first added.
const REINSTATE = defineScript(`
local key = KEYS[1]
local a = cjson.decode(ARGV[1])
local t = redis.call('TIME')
local epoch = math.floor((tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)) / a.lease_ms)
local cur = redis.call('HGET', key, 'inc')
if not cur then
  cur = t[1] .. '.' .. t[2]
  redis.call('HSET', key, 'inc', cur)
end
local added = 0
for _, r in ipairs(a.reservations) do
  local known = redis.call('HEXISTS', key, 'R:' .. r.id) == 1 or redis.call('HEXISTS', key, 'X:' .. r.id) == 1 or
    redis.call('HEXISTS', key, 'D:' .. r.id) == 1
  if not known and r.inc ~= cur then
    if r.tok > 0 then redis.call('HINCRBY', key, 'r' .. epoch .. ':tok', r.tok) end
    if r.usd > 0 then redis.call('HINCRBY', key, 'r' .. epoch .. ':usd', r.usd) end
    redis.call('HSET', key, 'R:' .. r.id, epoch .. ',' .. r.tok .. ',' .. r.usd)
    added = added + 1
  end
end
if added > 0 then
  local open = redis.call('HGET', key, 'open') or ''
  if not string.find(',' .. open .. ',', ',' .. epoch .. ',', 1, true) then
    redis.call('HSET', key, 'open', open == '' and tostring(epoch) or open .. ',' .. epoch)
  end
end
redis.call('PEXPIRE', key, a.ttl_ms)
return {cur, added}
`);

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
  const reservations = inFlight.map(({ id, tok, usd, inc }) => ({ id, tok: whole(tok), usd: whole(usd), inc }));
  const { reply } = await runOnHash(redis, ack, REINSTATE, key, { reservations });
  const [inc, added] = reply;
  return { inc: String(inc), added: Number(added) };
}
