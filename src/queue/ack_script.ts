import { defineScript } from "../redis/script.ts";

// ACK: acknowledges a stream's messages whose handlers have committed, deletes them (XDEL keeps the stream bounded
// without MAXLEN, which could trim pending entries), and starts the lifetime of each one's record: one command for
// what a MULTI of XACK, XDEL and EXPIREs did in five or more (on 20,000 lanes of a job each, every ack is its own).
// KEYS[1]  the stream.
// KEYS[2…] records (in the stream's hash tag) whose lifetime starts now.
// ARGV[1]  the group.
// ARGV[2]  n, how many entry ids follow.
// ARGV[3…2+n]   the entry ids.
// ARGV[3+n…]    the lifetime in seconds of each record of KEYS[2…], in order.
// Returns how many entries were acknowledged.
// Safe to run twice (a resend after a lost reply): XACK and XDEL of ids already gone do nothing, and EXPIRE sets
// the same lifetime again.
export const ACK_SCRIPT = defineScript(`
local n = tonumber(ARGV[2])
local acked = 0
for from = 3, 2 + n, 1000 do
  local ids = {}
  for i = from, math.min(from + 999, 2 + n) do ids[#ids + 1] = ARGV[i] end
  acked = acked + redis.call('XACK', KEYS[1], ARGV[1], unpack(ids))
  redis.call('XDEL', KEYS[1], unpack(ids))
end
for k = 2, #KEYS do redis.call('EXPIRE', KEYS[k], ARGV[2 + n + k - 1]) end
return acked`);
