import type { RedisClient } from "./client.ts";
import { defineScript } from "./script.ts";

// DELETE_IF_EQUAL: deletes a string key only while it holds the given value (nobody changed it since).
// KEYS[1]  the key.
// ARGV[1]  the value it must hold, compared as a number.
// Returns 1 when it was deleted.
// Safe to run twice (a resend after a lost reply): the second run finds the key gone, or holding another value.
const DELETE_IF_EQUAL = defineScript(`
if tonumber(redis.call('GET', KEYS[1]) or '-1') == tonumber(ARGV[1]) then return redis.call('DEL', KEYS[1]) end
return 0`);

/** Deletes `key` if it still holds the number `value`. @returns whether it did. */
export async function deleteIfEqual(redis: RedisClient, key: string, value: number): Promise<boolean> {
  return (await DELETE_IF_EQUAL.run(redis, [key], [value])) === 1;
}
