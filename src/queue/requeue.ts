import type { RedisClient } from "../clients.ts";
import { defineScript } from "../redis/script.ts";
import type { QueueNames, StreamMessage } from "./message.ts";

// REQUEUE: puts a delivered message back at the end of its stream as a new entry, in one step: acknowledged,
// deleted and added again, so it is never lost (nothing between the three) nor held twice, and its new
// entry starts with no deliveries.
// KEYS[1]  the stream.
// ARGV[1]  the group.   ARGV[2]  the entry id.   ARGV[3…]  the fields, flat.
// Returns the new entry's id, or false when the entry was no longer pending (another delivery settled it).
const REQUEUE = defineScript(`
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return false end
redis.call('XDEL', KEYS[1], ARGV[2])
return redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))`);

/**
 * Puts `message` back at the end of `lane`. The entry keeps its fields, and `accepted_ms` (when the job was
 * first accepted: the first entry id's time) so that latency still counts from acceptance.
 * @returns the new entry id, or null when the entry was no longer pending.
 */
export async function requeue(redis: RedisClient, lane: QueueNames, message: StreamMessage): Promise<string | null> {
  const fields = { ...message.fields };
  fields.accepted_ms ??= message.id.split("-")[0]!;
  const flat = Object.entries(fields).flat();
  return (await REQUEUE.run(redis, [lane.stream], [lane.group, message.id, ...flat])) as string | null;
}
