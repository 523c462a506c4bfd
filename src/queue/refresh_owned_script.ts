import { defineScript } from "../redis/script.ts";

// REFRESH_OWNED: refreshes the idle time of the entries a consumer still owns, and only those.
// KEYS[1]  the stream.
// ARGV[1]  the group.
// ARGV[2]  the consumer (an argument, not a key: on Redis Cluster every key must be in one slot).
// ARGV[3…] the entry ids.
// Returns the ids refreshed.
// Checking the owner and claiming in one script means a worker that stalled never steals back a message another
// worker has already reclaimed. XCLAIM ... JUSTID resets the idle time without bumping the delivery count.
// Safe to run twice (a resend after a lost reply): the owner is checked again, and the idle time reset again.
export const REFRESH_OWNED_SCRIPT = defineScript(`
local refreshed = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    table.insert(refreshed, ARGV[i])
  end
end
return refreshed`);
