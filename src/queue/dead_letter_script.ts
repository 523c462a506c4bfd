import type { RedisClient } from "../clients.ts";
import { defineScript } from "../redis/script.ts";

/** What the dead-letter script is asked to do (one JSON object). */
export interface DeadLetterArgs {
  /** The consumer group that delivered the message. */
  group: string;
  /** The message's entry id in the job stream. */
  id: string;
  /** The dead entry: field, value, field, value, ... */
  entry: string[];
  /** About how many dead letters to keep (XTRIM MAXLEN ~). */
  max_entries: number;
  /** The oldest dead letter to keep (XTRIM MINID ~). */
  min_id: string;
  /** With a record key: field, value, ... to set on it (HSET), and its lifetime (EXPIRE; 0 leaves it alone). */
  set?: string[];
  ttl_s?: number;
}

/** `[the dead entry's id, how many older dead letters the bounds dropped]`, or null when nothing was written. */
export type DeadLetterReply = [string, number] | null;

const DEAD_LETTER = defineScript(`
-- Dead letter: moves a delivered message to the dead-letter stream in one step (XADD dead, XACK, XDEL, the job's
-- record, the trim), and only while the message is still where its delivery left it: pending in the group, or in
-- the stream. Applied a second time (ioredis resends a command whose reply a dropped connection lost, and Redis
-- may have run it) it finds the message gone and writes nothing, so a job never has two dead letters, and a
-- replayed job is never marked failed again by a late copy.
-- KEYS[1]  the job stream.
-- KEYS[2]  the dead-letter stream.
-- KEYS[3]  the counter of dead letters the bounds dropped (same hash tag).
-- KEYS[4]  optional: the job's record (a hash, same hash tag).
-- ARGV[1]  JSON: {group, id (the message's entry id), entry: [field, value, …] (the dead entry), max_entries
--          (XTRIM MAXLEN ~), min_id (XTRIM MINID ~), and with KEYS[4]: set: [field, value, …] (HSET), ttl_s
--          (EXPIRE, when above 0)}
-- Returns {the dead entry's id, how many older dead letters the bounds dropped}, or false when the message is
-- neither pending nor in the stream (nothing written).
local a = cjson.decode(ARGV[1])
local here = #redis.call('XRANGE', KEYS[1], a.id, a.id) > 0
if not here then
  -- XPENDING fails without the group (NOGROUP): then nothing is pending either.
  local ok, pending = pcall(redis.call, 'XPENDING', KEYS[1], a.group, a.id, a.id, 1)
  here = ok and #pending > 0
end
if not here then return false end
local dead = redis.call('XADD', KEYS[2], '*', unpack(a.entry))
redis.call('XACK', KEYS[1], a.group, a.id)
redis.call('XDEL', KEYS[1], a.id)
if KEYS[4] then
  if #a.set > 0 then redis.call('HSET', KEYS[4], unpack(a.set)) end
  if (a.ttl_s or 0) > 0 then redis.call('EXPIRE', KEYS[4], a.ttl_s) end
end
local n = redis.call('XTRIM', KEYS[2], 'MAXLEN', '~', a.max_entries) + redis.call('XTRIM', KEYS[2], 'MINID', '~', a.min_id)
if n > 0 then redis.call('INCRBY', KEYS[3], n) end
return {dead, n}`);

/**
 * Runs the dead-letter script on `keys` (`[stream, dead, dropped]`, plus the job's record when `args.set` is
 * given). @returns the dead entry's id and how many the trim dropped, or null when the message was gone.
 */
export async function runDeadLetter(
  redis: RedisClient,
  keys: [string, string, string] | [string, string, string, string],
  args: DeadLetterArgs,
): Promise<DeadLetterReply> {
  const reply = await DEAD_LETTER.run(redis, keys, [JSON.stringify(args)]) as [string, number] | null;
  return reply ? [reply[0], Number(reply[1])] : null;
}
