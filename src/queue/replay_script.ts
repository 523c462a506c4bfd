import type { RedisClient } from "../clients.ts";
import type { ReplicaAck } from "../redis/replica_ack.ts";
import { defineScript } from "../redis/script.ts";

/** What the replay script is asked to do (one JSON object). */
export interface ReplayArgs {
  dead_id: string;
  /** This replay's id: the one that claimed the dead letter, or a fresh one. */
  token: string;
  /** The metadata fields of a dead entry, dropped from the re-enqueued entry. */
  meta: readonly string[];
  /** How long the replay record outlives the replay. */
  kept_ms: number;
  /** With a record key: change it only when the entry's `field` has this `value`; HSET `set`, HDEL `del`, PERSIST. */
  match?: { field: string; value: string };
  set?: string[];
  del?: string[];
  persist?: boolean;
}

/**
 * The new entry's id (this replay ran, now or before), or why nothing was written: another replay ran (its new
 * entry), another replay holds the dead letter, there is no such dead letter, or its fields were cut.
 */
export type ReplayReply = string | ["replayed", string] | ["claimed"] | ["gone"] | ["truncated", string];

const REPLAY = defineScript(`
-- Replay: re-enqueues a dead letter into its job stream and deletes it from the dead stream, in one step, once
-- per dead letter. Its replay record (KEYS[3]) names the replay that holds the dead letter (its token, from the
-- claim script) and, once this ran, the new entry. So this replay applied again (ioredis resends a command whose
-- reply a dropped connection lost) answers the same new entry and enqueues nothing more, and another replay of the
-- same dead letter finds it taken. An optional record changes in the same step, so a replayed job never reads as
-- failed while it is queued. An entry whose fields were truncated is left alone.
-- KEYS[1]  the job stream.
-- KEYS[2]  the dead-letter stream.
-- KEYS[3]  the dead letter's replay record (a hash: token, new_id; same hash tag).
-- KEYS[4]  optional: the record to change (same hash tag).
-- ARGV[1]  JSON: {dead_id, token (this replay's id), meta: [the metadata fields, dropped from the re-enqueued
--          entry], kept_ms (the replay record's lifetime once it ran), and with KEYS[4]: match: {field, value}
--          (change the record only when the entry's field has that value), set: [field, value, …] (HSET),
--          del: [field, …] (HDEL), persist: true to remove its expiry (PERSIST)}
-- Returns the new entry's id (also to this replay applied again), {'replayed', new entry id} when another replay
-- ran, {'claimed'} when another replay holds it, {'gone'} when there is no such dead letter, or {'truncated',
-- fields} when it was cut (nothing written, except that a replay answered again renews its record, so that a WAIT
-- after it covers the replay).
local a = cjson.decode(ARGV[1])
local held = redis.call('HMGET', KEYS[3], 'token', 'new_id')
if held[2] then
  if held[1] ~= a.token then return {'replayed', held[2]} end
  redis.call('PEXPIRE', KEYS[3], a.kept_ms)
  return held[2]
end
if held[1] and held[1] ~= a.token then return {'claimed'} end
local entries = redis.call('XRANGE', KEYS[2], a.dead_id, a.dead_id)
if #entries == 0 then return {'gone'} end
local meta = {}
for _, name in ipairs(a.meta) do meta[name] = true end
local flat = entries[1][2]
for i = 1, #flat, 2 do
  if flat[i] == 'dead_truncated' and flat[i + 1] ~= '' then return {'truncated', flat[i + 1]} end
end
local fields, matched = {}, false
for i = 1, #flat, 2 do
  local k = flat[i]
  if not meta[k] then
    table.insert(fields, k)
    table.insert(fields, flat[i + 1])
    if KEYS[4] and k == a.match.field and flat[i + 1] == a.match.value then matched = true end
  end
end
local id = redis.call('XADD', KEYS[1], '*', unpack(fields))
redis.call('XDEL', KEYS[2], a.dead_id)
if matched then
  if #a.set > 0 then redis.call('HSET', KEYS[4], unpack(a.set)) end
  if #a.del > 0 then redis.call('HDEL', KEYS[4], unpack(a.del)) end
  if a.persist then redis.call('PERSIST', KEYS[4]) end
end
redis.call('HSET', KEYS[3], 'token', a.token, 'new_id', id)
redis.call('PEXPIRE', KEYS[3], a.kept_ms)
return id`);

/**
 * Runs the replay script on `keys` (`[stream, dead, replay record]`, plus the record to change), with a WAIT in
 * the same round trip when `ack` is given. @returns its reply, and with `ack` how many replicas acknowledged it.
 * @throws NotReplicated when no connection came free to wait for the replicas (nothing ran).
 */
export async function runReplay(
  redis: RedisClient,
  keys: string[],
  args: ReplayArgs,
  ack?: ReplicaAck,
): Promise<{ reply: ReplayReply; acked?: number; replicated?: boolean }> {
  const json = [JSON.stringify(args)];
  if (!ack) return { reply: await REPLAY.run(redis, keys, json) as ReplayReply };
  const { result, acked, replicated } = await ack.run(REPLAY, keys, json);
  return { reply: result as ReplayReply, acked, replicated };
}
