import type { RedisClient } from "../clients.ts";
import { createBatcher } from "../async/batcher.ts";
import { ACK_SCRIPT } from "./ack_script.ts";
import type { QueueNames } from "./message.ts";

/** One message to acknowledge: the stream of its lane it came from, and its entry id. */
export interface AckItem {
  stream: QueueNames;
  id: string;
  /** A record of the message's (same hash tag) that expires from the ack on: EXPIRE in the same MULTI. */
  expire?: { key: string; ttlS: number };
}

/**
 * Acknowledges messages whose handlers have committed. Acks that finish
 * together share one script per stream (`ack_script.ts`): XACK + XDEL of their
 * ids, and the EXPIRE of their records.
 * @returns a function resolving once its message's ack has committed.
 * @throws the script's error when it fails; the message then stays pending.
 */
export function createAckBatcher(redis: RedisClient): (item: AckItem) => Promise<void> {
  return createBatcher<AckItem>(async (items) => {
    const byStream = groupByStream(items);
    await Promise.all([...byStream.values()].map(async ({ stream, ids, expire }) => {
      await ACK_SCRIPT.run(
        redis,
        [stream.stream, ...expire.map((e) => e.key)],
        [stream.group, ids.length, ...ids, ...expire.map((e) => e.ttlS)],
      );
    }));
    return items.map(() => undefined);
  });
}

/** Groups messages by their stream, keeping each stream's ids in order. */
export function groupByStream(
  items: Iterable<AckItem>,
): Map<string, { stream: QueueNames; ids: string[]; expire: { key: string; ttlS: number }[] }> {
  const byStream = new Map<string, { stream: QueueNames; ids: string[]; expire: { key: string; ttlS: number }[] }>();
  for (const { stream, id, expire } of items) {
    const entry = byStream.get(stream.stream) ?? { stream, ids: [], expire: [] };
    entry.ids.push(id);
    if (expire) entry.expire.push(expire);
    byStream.set(stream.stream, entry);
  }
  return byStream;
}
