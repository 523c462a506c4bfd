import type { RedisClient } from "../clients.ts";
import { defineScript } from "../redis/script.ts";

// DELETE_EMPTY_STREAM: deletes a stream, and its groups with it, only while it holds nothing.
// KEYS[1]  the stream.
// Returns 1 when it was deleted.
const DELETE_EMPTY_STREAM = defineScript(`
if redis.call('XLEN', KEYS[1]) > 0 then return 0 end
return redis.call('DEL', KEYS[1])`);

/** Deletes `stream` (and its consumer groups) if it has no entries, in one step. @returns whether it did. */
export async function deleteEmptyStream(redis: RedisClient, stream: string): Promise<boolean> {
  return (await DELETE_EMPTY_STREAM.run(redis, [stream], [])) === 1;
}
