import { defineScript } from "../redis/script.ts";

// Mark started: records in the job's record that a run with an expiry has sent its first model attempt
// (`run_expiry.ts`), before the attempt goes out. The first mark stands (HSETNX): it says when the run started.
// A record that is missing (never seen in practice: intake writes it with the message) is created with the
// record's lifetime, so the mark is never lost and never outlives the job's records.
// KEYS[1]  the job's record (hash)
// ARGV[1]  when the attempt goes out, epoch ms
// ARGV[2]  the lifetime of a record created here, seconds
// Returns 1 when this call marked it, 0 when it was marked before.
// Safe to run twice: the second run changes nothing.
export const MARK_STARTED_SCRIPT = defineScript(`
local fresh = redis.call('EXISTS', KEYS[1]) == 0
local marked = redis.call('HSETNX', KEYS[1], 'started', ARGV[1])
if fresh then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return marked`);
