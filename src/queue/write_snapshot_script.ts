import { defineScript } from "../redis/script.ts";

// WRITE_SNAPSHOT: stores the backlog's snapshot (`backlog.ts`) unless the stored one is as new or newer.
// KEYS[1]  the snapshot hash.
// ARGV[1]  the snapshot's time, ms since the epoch. ARGV[2] the snapshot, JSON.
// Returns 1 when it wrote, else 0. Safe to run twice: the second run finds its own time stored and writes nothing;
// a slow walker's older snapshot never replaces a newer one.
export const WRITE_SNAPSHOT_SCRIPT = defineScript(`
local stored = tonumber(redis.call('HGET', KEYS[1], 'at') or '0')
if tonumber(ARGV[1]) <= stored then return 0 end
redis.call('HSET', KEYS[1], 'at', ARGV[1], 'snapshot', ARGV[2])
return 1`);
