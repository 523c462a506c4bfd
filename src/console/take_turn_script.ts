import { defineScript } from "../redis/script.ts";

// TAKE TURN: reserves the next turn of the console's token check.
// KEYS[1]: next_turn, the Redis time (ms) from which the next check may run.
// ARGV[1]: the turn's length in ms. ARGV[2]: the longest wait granted, in ms.
// Returns {wait_ms, turn_start_ms}: the caller checks after wait_ms. Or {-1, wait_ms} when the turn would
// come later than ARGV[2]: then nothing is reserved.
// Redis's own clock, so every API process agrees on the order.
// Run twice (a resend after a lost reply), it reserves a second turn, and its caller waits for that one: the checks
// queued behind it wait one turn longer. That errs the safe way (slower guessing, never faster), so it is left so.
export const TAKE_TURN_SCRIPT = defineScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local start = math.max(now, tonumber(redis.call('GET', KEYS[1]) or '0'))
if start - now > tonumber(ARGV[2]) then return {-1, start - now} end
local after = start + tonumber(ARGV[1])
redis.call('SET', KEYS[1], string.format('%.0f', after), 'PX', math.floor(after - now) + 1000)
return {start - now, start}`);
