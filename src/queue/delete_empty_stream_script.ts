import type { RedisClient } from "../clients.ts";
import { defineScript } from "../redis/script.ts";

// DELETE_EMPTY_STREAM: deletes a stream, and its groups with it, only while it holds nothing.
// KEYS[1]  the stream.
// ARGV     none.
// Returns 1 when the stream is gone (deleted now, or not there), 0 when it holds entries.
// Safe to run twice: a second run finds nothing to delete, and answers as the first did (the client resends a
// call whose reply was lost, and Redis may have run it).
const DELETE_EMPTY_STREAM = defineScript(`
if redis.call('XLEN', KEYS[1]) > 0 then return 0 end
redis.call('DEL', KEYS[1])
return 1`);

/** Deletes `stream` (and its consumer groups) if it has no entries, in one step. @returns whether it is gone. */
export async function deleteEmptyStream(redis: RedisClient, stream: string): Promise<boolean> {
  return (await DELETE_EMPTY_STREAM.run(redis, [stream], [])) === 1;
}
