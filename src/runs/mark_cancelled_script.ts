import { defineScript } from "../redis/script.ts";

// Mark cancelled: records a cancel Postgres decided in the job's record. Only an existing record changes: a
// cancel never creates one for a job Redis no longer knows.
// KEYS[1]  the job's record (hash)
// Returns 1 when the record was changed, 0 when there was none.
// Safe to run twice: the second run sets the same status again.
export const MARK_CANCELLED_SCRIPT = defineScript(`
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'status', 'cancelled')
redis.call('HDEL', KEYS[1], 'error')
return 1`);
