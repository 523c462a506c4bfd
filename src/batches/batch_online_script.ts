import { defineScript } from "../redis/script.ts";

// ONLINE: puts a batch run on its lane's low stream, once.
// KEYS[1]   the lane's low stream.
// KEYS[2]   the run's status record.
// KEYS[3]   the run's online marker (`LaneKeys.batchOnline`).
// KEYS[4…]  the registry sets that make the lane known (`laneKnownArgs`).
// ARGV[1]   JSON: {fields: [k, v, …] (the entry's), record: [k, v, …] (the record's fields), marker_ttl_s, lane,
//           wake (channel, '' for none)}.
// Returns 1 when the entry was added, 0 when the marker says an earlier send added it.
// Safe to run twice: the marker and the entry are written together, so a second run adds nothing but the marker's
// expiry: a write, so that a WAIT after it (REDIS_MIN_REPLICAS_ACK) covers the earlier send's entry too, which
// another connection may have written.
export const ONLINE_SCRIPT = defineScript(`
local a = cjson.decode(ARGV[1])
if not redis.call('SET', KEYS[3], '1', 'NX', 'EX', a.marker_ttl_s) then
  redis.call('EXPIRE', KEYS[3], a.marker_ttl_s)
  return 0
end
redis.call('XADD', KEYS[1], '*', unpack(a.fields))
redis.call('HSET', KEYS[2], unpack(a.record))
-- Queued again: the record lives as long as the run waits (the ack of its batch delivery had set an expiry).
redis.call('PERSIST', KEYS[2])
for i = 4, #KEYS do redis.call('SADD', KEYS[i], a.lane) end
if a.wake ~= '' then redis.call('PUBLISH', a.wake, a.lane) end
return 1`);
