import { defineScript } from "../redis/script.ts";

// MOVE_INTO_LANE: adds one entry of the old stream to its tenant's lane, once.
// KEYS[1]   the lane's intake stream.
// KEYS[2]   the job's status record in the lane.
// KEYS[3]   the lane's marker for the old entry.
// KEYS[4…]  the registry sets that make the lane known (`laneKnownArgs`).
// ARGV[1]   JSON: { fields: [k, v, …] (the entry's), record: [k, v, …] (the old status record, [] if none),
//           record_ttl_ms (its PTTL; <= 0: none), marker_ttl_s, lane (the lane id), wake (channel, '' for none) }.
// Returns 1 when the entry was added, 0 when the marker says an earlier drain added it.
// Safe to run twice (a resend after a lost reply): the marker makes the second run add nothing.
export const MOVE_INTO_LANE_SCRIPT = defineScript(`
local a = cjson.decode(ARGV[1])
if not redis.call('SET', KEYS[3], '1', 'NX', 'EX', a.marker_ttl_s) then return 0 end
redis.call('XADD', KEYS[1], '*', unpack(a.fields))
if #a.record > 0 and redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('HSET', KEYS[2], unpack(a.record))
  if a.record_ttl_ms > 0 then redis.call('PEXPIRE', KEYS[2], a.record_ttl_ms) end
end
for i = 4, #KEYS do redis.call('SADD', KEYS[i], a.lane) end
if a.wake ~= '' then redis.call('PUBLISH', a.wake, a.lane) end
return 1`);
