import type { RedisClient } from "../clients.ts";
import { createBatcher } from "../async/batcher.ts";
import type { QueueNames } from "./message.ts";

/** One message to acknowledge: its lane and entry id. */
export interface AckItem {
  lane: QueueNames;
  id: string;
  /** A record of the message's (same hash tag) that expires from the ack on: EXPIRE in the same MULTI. */
  expire?: { key: string; ttlS: number };
}

/**
 * Acknowledges messages whose handlers have committed. Acks that finish
 * together share one MULTI per lane: XACK + XDEL of their ids. XDEL keeps the
 * stream bounded without MAXLEN, which could trim pending entries.
 * @returns a function resolving once its message's ack has committed.
 * @throws the MULTI's error when it fails; the message then stays pending.
 */
export function createAckBatcher(redis: RedisClient): (item: AckItem) => Promise<void> {
  return createBatcher<AckItem>(async (items) => {
    const byLane = groupByLane(items);
    await Promise.all([...byLane.values()].map(async ({ lane, ids, expire }) => {
      // Every command here is safe to run twice (a resend after a lost reply): XACK and XDEL of ids already gone
      // do nothing, and EXPIRE sets the same lifetime again.
      const multi = redis.multi().xack(lane.stream, lane.group, ...ids).xdel(lane.stream, ...ids);
      for (const { key, ttlS } of expire) multi.expire(key, ttlS);
      const results = await multi.exec();
      const failed = results?.find(([error]) => error);
      if (!results || failed) throw failed?.[0] ?? new Error("ack transaction aborted");
    }));
    return items.map(() => undefined);
  });
}

/** Groups messages by their lane's stream, keeping each lane's ids in order. */
export function groupByLane(
  items: Iterable<AckItem>,
): Map<string, { lane: QueueNames; ids: string[]; expire: { key: string; ttlS: number }[] }> {
  const byLane = new Map<string, { lane: QueueNames; ids: string[]; expire: { key: string; ttlS: number }[] }>();
  for (const { lane, id, expire } of items) {
    const entry = byLane.get(lane.stream) ?? { lane, ids: [], expire: [] };
    entry.ids.push(id);
    if (expire) entry.expire.push(expire);
    byLane.set(lane.stream, entry);
  }
  return byLane;
}
