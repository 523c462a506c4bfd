import { defineScript } from "../redis/script.ts";

// CLAIM: a result-cache lookup that, on a miss, makes the caller the one run computing the entry.
// KEYS[1]  the entry (`CacheKeys.entry`).
// KEYS[2]  the entry's lock (`CacheKeys.lock`; both share the tenant's hash tag).
// ARGV[1]  the caller's run id: the lock's holder.
// ARGV[2]  the lock's lease in ms.
// Returns the entry (a JSON string) when there is one; else 1 when the caller now holds the lock (it was free or
// lapsed, or it was already the caller's: a redelivery of the holder, whose lease starts again), 0 when another
// run holds it.
// Safe to run twice (a resend after a lost reply): the holder's second run finds the lock its own and only starts
// its lease again; an entry or another holder is answered as the first run would have been, or as it is now.
export const CLAIM_SCRIPT = defineScript(`
local entry = redis.call('GET', KEYS[1])
if entry then return entry end
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return 1`);
