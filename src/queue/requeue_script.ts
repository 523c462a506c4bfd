import { defineScript } from "../redis/script.ts";

// REQUEUE: puts a delivered message back at the end of its stream as a new entry, in one step: acknowledged,
// deleted and added again, so it is never lost (nothing between the three) nor held twice, and its new
// entry starts with no deliveries.
// KEYS[1]  the stream.
// KEYS[2]  the entry's requeue record (requeueRecordKey): the new entry's id, and the consumer that put it back.
// ARGV[1]  the group.   ARGV[2]  the entry id.   ARGV[3]  the consumer that holds it.
// ARGV[4]  the record's lifetime, in ms.   ARGV[5…]  the fields, flat.
// Returns the new entry's id, or false when the entry is no longer this consumer's (another delivery settled it, or
// another worker reclaimed it: its delivery is left alone).
// Safe to run twice: the entry must still be pending to the consumer, so a second run adds nothing. The record lets
// it answer as the first did (the client resends a requeue whose reply was lost, and Redis may have run it): told
// false, the worker would not wake the lane's readers for the new entry, nor count the deferral.
export const REQUEUE_SCRIPT = defineScript(`
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #p ~= 1 or p[1][2] ~= ARGV[3] then
  local record = redis.call('GET', KEYS[2])
  if record then
    local id, by = string.match(record, '^(%S+) (.*)$')
    if by == ARGV[3] then return id end
  end
  return false
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 5))
redis.call('SET', KEYS[2], id .. ' ' .. ARGV[3], 'PX', ARGV[4])
return id`);
