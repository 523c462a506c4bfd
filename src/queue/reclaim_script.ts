import { defineScript } from "../redis/script.ts";

// RECLAIM: takes over the messages of a lane's stream idle past the claim idle time (XAUTOCLAIM).
// KEYS[1]  the stream.
// KEYS[2]  the consumer's reclaim record of the stream (reclaimRecordKey): the last reclaim's id, its next cursor and
//          the ids it claimed.
// ARGV[1]  the group.   ARGV[2]  the consumer.   ARGV[3]  the claim idle time, in ms.   ARGV[4]  the cursor.
// ARGV[5]  how many messages to claim at most.   ARGV[6]  this reclaim's id.   ARGV[7]  the record's lifetime, in ms.
// Returns XAUTOCLAIM's {next cursor, entries}.
// Safe to run twice: the client resends a reclaim whose reply was lost with its connection, and Redis may have run
// it. Run again, XAUTOCLAIM would pass over the messages the first run claimed (idle no more), and those would wait
// another claim idle time and spend one more delivery, perhaps their last. So the reclaim whose id the record holds
// answers what it claimed, those messages still pending to this consumer.
export const RECLAIM_SCRIPT = defineScript(`
local record = redis.call('GET', KEYS[2])
if record then
  local call, next, ids = string.match(record, '^(%S+) (%S+) (.*)$')
  if call == ARGV[6] then
    local entries = {}
    for id in string.gmatch(ids, '[^,]+') do
      if #redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1, ARGV[2]) == 1 then
        local entry = redis.call('XRANGE', KEYS[1], id, id)[1]
        if entry then entries[#entries + 1] = entry end
      end
    end
    return {next, entries}
  end
end
local claimed = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], 'COUNT', ARGV[5])
local ids = {}
for i, entry in ipairs(claimed[2]) do ids[i] = entry[1] end
if #ids > 0 then
  redis.call('SET', KEYS[2], ARGV[6] .. ' ' .. claimed[1] .. ' ' .. table.concat(ids, ','), 'PX', ARGV[7])
end
return {claimed[1], claimed[2]}`);
