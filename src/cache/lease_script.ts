import { defineScript } from "../redis/script.ts";

// LEASE: renews or ends a result-cache lock, only while the caller holds it (a lapsed lease may have been taken
// over by another run, whose lock this must not touch).
// KEYS[1]  the entry's lock (`CacheKeys.lock`).
// ARGV[1]  the caller's run id.
// ARGV[2]  the new lease in ms, or 0 to end the lock.
// Returns 1 when the caller held the lock, 0 otherwise.
// Safe to run twice (a resend after a lost reply): the holder is checked again, so a second end never deletes the
// lock a waiter took meanwhile, and a second renewal only restarts the holder's own lease.
export const LEASE_SCRIPT = defineScript(`
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '0' then redis.call('DEL', KEYS[1]) else redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1`);
