import { defineScript } from "../redis/script.ts";

// ANNOUNCE_LANE: tells workers about new work in a lane, in one command: both registry sets (one slot) and the
// wake-up.
// KEYS[1]  the registry's set of lanes with work (active).
// KEYS[2]  the registry's set of every lane (all).
// ARGV[1]  the lane id.
// ARGV[2]  the wake-up channel.
// Returns 1.
// Safe to run twice (a resend after a lost reply): the sets already hold the lane; idle workers wake once more.
export const ANNOUNCE_LANE_SCRIPT = defineScript(`
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('PUBLISH', ARGV[2], ARGV[1])
return 1`);
