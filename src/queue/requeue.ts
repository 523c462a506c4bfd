import type { RedisClient } from "../clients.ts";
import { defineScript } from "../redis/script.ts";
import type { QueueNames, StreamMessage } from "./message.ts";

/** Defaults of {@linkcode requeue}. */
export const REQUEUE_DEFAULTS = {
  /** How long a requeue's record is kept, for a resend of that requeue (see REQUEUE). */
  recordMs: 120_000,
} as const;

// REQUEUE: puts a delivered message back at the end of its stream as a new entry, in one step: acknowledged,
// deleted and added again, so it is never lost (nothing between the three) nor held twice, and its new
// entry starts with no deliveries.
// KEYS[1]  the stream.
// KEYS[2]  the entry's requeue record (requeueRecordKey): the new entry's id, and the consumer that put it back.
// ARGV[1]  the group.   ARGV[2]  the entry id.   ARGV[3]  the consumer that holds it.
// ARGV[4]  the record's lifetime, in ms.   ARGV[5…]  the fields, flat.
// Returns the new entry's id, or false when the entry is no longer this consumer's (another delivery settled it, or
// another worker reclaimed it: its delivery is left alone).
// Safe to run twice: the entry must still be pending to the consumer, so a second run adds nothing. The record lets
// it answer as the first did (the client resends a requeue whose reply was lost, and Redis may have run it): told
// false, the worker would not wake the lane's readers for the new entry, nor count the deferral.
const REQUEUE = defineScript(`
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #p ~= 1 or p[1][2] ~= ARGV[3] then
  local record = redis.call('GET', KEYS[2])
  if record then
    local id, by = string.match(record, '^(%S+) (.*)$')
    if by == ARGV[3] then return id end
  end
  return false
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 5))
redis.call('SET', KEYS[2], id .. ' ' .. ARGV[3], 'PX', ARGV[4])
return id`);

/** The record of a requeue of entry `id` of `stream` (a stream of a lane), in the lane's slot. */
export function requeueRecordKey(stream: string, id: string): string {
  return `${stream}:requeued:${id}`;
}

/** Deliveries the message's job had before it was last deferred (`prior_deliveries`), 0 for most. */
export function priorDeliveries(message: StreamMessage): number {
  const n = Number(message.fields.prior_deliveries ?? 0);
  return Number.isSafeInteger(n) && n > 0 ? n : 0;
}

/**
 * Puts `message` back at the end of `stream`, the stream of its lane it came from. The entry keeps its fields, and
 * `accepted_ms` (when the job was first accepted: the first entry id's time) so that latency still counts from
 * acceptance.
 * @returns the new entry id, or null when `consumer` no longer holds the entry (settled, or reclaimed by another).
 */
export async function requeue(
  redis: RedisClient,
  stream: QueueNames,
  message: StreamMessage,
  consumer: string,
): Promise<string | null> {
  const fields = { ...message.fields };
  fields.accepted_ms ??= message.id.split("-")[0]!;
  // The deliveries before this one still count toward MAX_DELIVERIES (the deferred delivery itself does not), so
  // a run that keeps failing cannot start afresh by being deferred.
  const prior = priorDeliveries(message) + message.deliveries - 1;
  if (prior > 0) fields.prior_deliveries = String(prior);
  const flat = Object.entries(fields).flat();
  return (await REQUEUE.run(redis, [stream.stream, requeueRecordKey(stream.stream, message.id)], [
    stream.group,
    message.id,
    consumer,
    REQUEUE_DEFAULTS.recordMs,
    ...flat,
  ])) as string | null;
}
