import { defineScript } from "../redis/script.ts";

// HAS_UNDELIVERED: whether any of a lane's streams holds messages not yet delivered to its group, in one command
// (the look after a lane left the registry's lanes with work, once per drained lane).
// KEYS[1…] the lane's streams (one slot: they share the lane's hash tag).
// ARGV[1]  the group.
// Returns 1 when one does, else 0. Acked entries are deleted (XDEL), so a stream longer than its group's pending
// entries holds undelivered ones; a stream without the group (never read) holds only undelivered ones.
// Reads only: safe to run twice.
export const HAS_UNDELIVERED_SCRIPT = defineScript(`
for k = 1, #KEYS do
  local length = redis.call('XLEN', KEYS[k])
  if length > 0 then
    local ok, summary = pcall(redis.call, 'XPENDING', KEYS[k], ARGV[1])
    if not ok or length > summary[1] then return 1 end
  end
end
return 0`);
