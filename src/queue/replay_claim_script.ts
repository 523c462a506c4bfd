import type { RedisClient } from "../clients.ts";
import { defineScript } from "../redis/script.ts";

/** What the claim script answered: claimed (or given up), or why not. */
export type ClaimReply = "ok" | ["replayed", string] | ["claimed"] | ["gone"];

const CLAIM_REPLAY = defineScript(`
-- Claim replay: reserves a dead letter for one replay (its token) for claim_ms, before that replay's other steps
-- (Postgres takes the job's failure back, then the replay script runs), so that a second replay of the same dead
-- letter, started meanwhile, stops before it changes anything. The same claim applied again (a resend) only
-- renews it; claim_ms 0 gives it up. A replay that already ran is answered by its record, which the replay
-- script keeps.
-- KEYS[1]  the dead-letter stream.
-- KEYS[2]  the dead letter's replay record (a hash: token, new_id; same hash tag).
-- ARGV[1]  JSON: {dead_id, token (the replay's id), claim_ms (0: give this token's claim up)}
-- Returns 'ok' (claimed, renewed or given up), {'replayed', new entry id} when a replay of it already ran,
-- {'claimed'} when another replay holds it, {'gone'} when there is no such dead letter (nothing written).
local a = cjson.decode(ARGV[1])
local held = redis.call('HMGET', KEYS[2], 'token', 'new_id')
if held[2] then return {'replayed', held[2]} end
if held[1] and held[1] ~= a.token then return {'claimed'} end
if a.claim_ms == 0 then
  redis.call('DEL', KEYS[2])
  return 'ok'
end
if #redis.call('XRANGE', KEYS[1], a.dead_id, a.dead_id) == 0 then return {'gone'} end
redis.call('HSET', KEYS[2], 'token', a.token)
redis.call('PEXPIRE', KEYS[2], a.claim_ms)
return 'ok'`);

/** Runs the claim script on `[dead, replay record]`. */
export async function runClaimReplay(
  redis: RedisClient,
  keys: [string, string],
  args: { dead_id: string; token: string; claim_ms: number },
): Promise<ClaimReply> {
  return await CLAIM_REPLAY.run(redis, keys, [JSON.stringify(args)]) as ClaimReply;
}
