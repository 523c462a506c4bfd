import { defineScript } from "../redis/script.ts";

// FILL: stores a done run's entry for the TTL, and ends the entry's lock if the run holds it (in one step, so a
// waiter polling for the entry never finds the lock free and the entry missing, which would cost a second call).
// KEYS[1]  the entry (`CacheKeys.entry`).
// KEYS[2]  the entry's lock (`CacheKeys.lock`; both share the tenant's hash tag).
// ARGV[1]  the entry: JSON { source_run_id, output, model, prompt_tokens, completion_tokens }.
// ARGV[2]  the entry's TTL in ms.
// ARGV[3]  the run's id: the lock is deleted only while it holds this value.
// Returns 1.
// Safe to run twice (a resend after a lost reply): the second run stores the same entry again (its TTL restarts),
// and ends the lock only if this run still holds it, which it cannot: a run that finds the entry takes no lock.
export const FILL_SCRIPT = defineScript(`
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if redis.call('GET', KEYS[2]) == ARGV[3] then redis.call('DEL', KEYS[2]) end
return 1`);
