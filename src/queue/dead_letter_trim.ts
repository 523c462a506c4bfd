import type { ChainableCommander } from "ioredis";

// TRIM_DEAD_LETTERS: bounds a dead-letter stream by length and by age, counting what it dropped.
// KEYS[1]  the dead-letter stream.
// KEYS[2]  the counter of dead letters dropped by the bounds (same hash tag).
// ARGV[1]  about how many entries to keep (XTRIM MAXLEN ~).
// ARGV[2]  the oldest entry id to keep (XTRIM MINID ~).
// Returns how many entries were dropped.
const TRIM_DEAD_LETTERS = `
local n = redis.call('XTRIM', KEYS[1], 'MAXLEN', '~', ARGV[1]) + redis.call('XTRIM', KEYS[1], 'MINID', '~', ARGV[2])
if n > 0 then redis.call('INCRBY', KEYS[2], n) end
return n`;

/**
 * Queues the trim of `dead` in `multi` (run as EVAL inside the dead-letter MULTI, so the new dead letter and
 * the trim are one step): at most about `maxEntries`, none older than `minId`, the count of dropped entries
 * added to `dropped`. Its reply in the MULTI's results is how many were dropped.
 */
export function queueDeadLetterTrim(
  multi: ChainableCommander,
  { dead, dropped, maxEntries, minId }: { dead: string; dropped: string; maxEntries: number; minId: string },
): ChainableCommander {
  return multi.eval(TRIM_DEAD_LETTERS, 2, dead, dropped, maxEntries, minId);
}
