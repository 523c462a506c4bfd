import { defineScript } from "../redis/script.ts";

// DECIDE START: whether a run with an expiry started its model call or expired, decided once, in the run's job
// record (`run_expiry.ts`). The field `started` holds the decision: the epoch ms at which its first attempt was
// let go out, or 'expired'. The first decision stands, whoever asks later: a worker about to send the run's first
// attempt ('start') or one about to decide it expired ('expire'), in any delivery, concurrent ones included.
// A 'start' with no decision yet is let go out only before the run's expiry by Redis's clock (one clock for
// every worker), else it decides 'expired'; an 'expire' with none decides 'expired'.
// The decision is written again on every call, even when it was made before (the same value): a WAIT after it
// (REDIS_MIN_REPLICAS_ACK) then covers it, whichever connection wrote it first, so a worker acts on a decision
// only once the replicas have it. A record that is missing (never seen in practice: intake writes it with the
// message) is created with the record's lifetime, so the decision is never lost and never outlives the job's
// records.
// KEYS[1]  the job's record (hash)
// ARGV[1]  'start' or 'expire'
// ARGV[2]  the run's expiry, epoch ms
// ARGV[3]  the lifetime of a record created here, seconds
// Returns the decision: the start's epoch ms (as a string), or 'expired'.
// Safe to run twice: the second run finds the first's decision and answers it.
export const MARK_STARTED_SCRIPT = defineScript(`
local fresh = redis.call('EXISTS', KEYS[1]) == 0
local decided = redis.call('HGET', KEYS[1], 'started')
if not decided then
  decided = 'expired'
  if ARGV[1] == 'start' then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    if now < tonumber(ARGV[2]) then decided = tostring(now) end
  end
end
redis.call('HSET', KEYS[1], 'started', decided)
if fresh then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
return decided`);
