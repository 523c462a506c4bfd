import { defineScript } from "../redis/script.ts";

// DELETE_IDLE_CONSUMER: removes a consumer from a group only if it still holds nothing and has been idle long
// enough, checked and done in one step: a consumer that read or reclaimed a message since the caller's look is
// left alone (XGROUP DELCONSUMER would drop its pending messages for good).
// KEYS[1]  the stream.
// ARGV[1]  the group.
// ARGV[2]  the consumer.
// ARGV[3]  the least idle time, in ms.
// Returns 1 when it was removed, else 0.
// Safe to run twice (a resend after a lost reply): the second run finds the consumer gone and answers 0; the pruner
// then leaves it out of its log line, nothing else.
export const DELETE_IDLE_CONSUMER_SCRIPT = defineScript(`
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local f = {}
  for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
  if f['name'] == ARGV[2] then
    if tonumber(f['pending']) ~= 0 or tonumber(f['idle']) < tonumber(ARGV[3]) then return 0 end
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
    return 1
  end
end
return 0`);
