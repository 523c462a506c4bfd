import type { RedisClient } from "../clients.ts";
import { REQUEUE_SCRIPT } from "./requeue_script.ts";
import type { QueueNames, StreamMessage } from "./message.ts";

/** Defaults of {@linkcode requeue}. */
export const REQUEUE_DEFAULTS = {
  /** How long a requeue's record is kept, for a resend of that requeue (see `requeue_script.ts`). */
  recordMs: 120_000,
} as const;

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
  return (await REQUEUE_SCRIPT.run(redis, [stream.stream, requeueRecordKey(stream.stream, message.id)], [
    stream.group,
    message.id,
    consumer,
    REQUEUE_DEFAULTS.recordMs,
    ...flat,
  ])) as string | null;
}
