import type { RedisClient } from "../clients.ts";
import { createBatcher } from "../async/batcher.ts";
import { settlesWithin, sleep } from "../async/timeout.ts";
import type { Logger } from "../log/logger.ts";
import { defineScript } from "../redis/script.ts";
import { deadLetter, type DeadLetterHook } from "./dead_letter.ts";
import { PermanentJobError } from "./errors.ts";
import { fieldsToObject, type QueueNames, type StreamMessage } from "./message.ts";

/** Handles one message. Resolve to acknowledge; throw to leave it pending for redelivery. */
export type MessageHandler = (message: StreamMessage, signal: AbortSignal) => Promise<unknown>;

/** Counters a worker reports; wire them to metrics. */
export interface WorkerEvents {
  delivered?(message: StreamMessage, source: "new" | "reclaimed"): void;
  acked?(message: StreamMessage, durationMs: number): void;
  failed?(message: StreamMessage, error: unknown): void;
  deadLettered?(message: StreamMessage, reason: string): void;
  inFlight?(count: number): void;
}

/** Options for {@linkcode createStreamWorker}. */
export interface StreamWorkerOptions extends QueueNames {
  /** Unique per process: host + pid + random. */
  consumer: string;
  /** Idle time after which another consumer may reclaim a pending message. */
  claimIdleMs: number;
  /** Deliveries allowed before a message is dead-lettered. */
  maxDeliveries: number;
  /** Handlers running at once in this process. */
  concurrency: number;
  /** How long one XREADGROUP blocks waiting for new messages. */
  blockMs?: number;
  /** How often in-flight messages' idle time is refreshed; default `claimIdleMs / 4`. */
  heartbeatMs?: number;
  /** Time in-flight handlers get to finish after stop; the rest stay pending. */
  graceMs?: number;
  /**
   * Consumers idle this long with nothing pending are removed from the group
   * (each process restart adds a consumer name). Default `max(3 × claimIdleMs, 60 s)`.
   */
  pruneIdleMs?: number;
  onDeadLetter?: DeadLetterHook;
  events?: WorkerEvents;
  /**
   * Asked before each read: how many messages the downstream can start soon.
   * With no permits the worker reads nothing (jobs wait in the stream, not in
   * memory, and spend no delivery) and asks again after `waitMs`.
   */
  gate?: () => Promise<{ permits: number; waitMs: number }>;
}

/** A running consumer. */
export interface StreamWorker {
  /** One iteration: reclaim idle messages, read new ones into free slots, start their handlers. @returns how many were started. */
  runOnce(blockMs?: number): Promise<number>;
  /** Loops until `signal` aborts, then drains in-flight handlers up to the grace period. */
  run(signal: AbortSignal): Promise<void>;
  /** Resolves when every in-flight handler has settled. */
  drain(): Promise<void>;
  /** Refreshes the idle time of in-flight messages this consumer still owns. @returns the ids refreshed. */
  heartbeat(): Promise<string[]>;
  /** Removes other consumers that hold nothing and have been idle past `pruneIdleMs`. @returns their names. */
  pruneConsumers(): Promise<string[]>;
  readonly inFlight: number;
  /** Closes the blocking connection this worker opened. */
  close(): Promise<void>;
}

// Refresh idle time only for entries this consumer still owns. Checking the
// owner and claiming in one script means a worker that stalled never steals
// back a message another worker has already reclaimed. XCLAIM ... JUSTID
// resets the idle time without bumping the delivery count.
// KEYS: the stream. ARGV: the group, the consumer, then the ids. The consumer
// is an argument, not a key: on Redis Cluster every key must be in one slot.
const HEARTBEAT = defineScript(`
local refreshed = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    table.insert(refreshed, ARGV[i])
  end
end
return refreshed`);

type RawEntry = [id: string, fields: string[] | null];

/** Ensures the consumer group exists (creating the stream if needed). */
export async function ensureGroup(redis: RedisClient, names: QueueNames): Promise<void> {
  try {
    await redis.xgroup("CREATE", names.stream, names.group, "0", "MKSTREAM");
  } catch (error) {
    if (!(error instanceof Error) || !error.message.startsWith("BUSYGROUP")) throw error;
  }
}

/**
 * Creates a consumer-group worker with at-least-once delivery: messages are
 * acknowledged only after their handler resolves, reclaimed with XAUTOCLAIM
 * when idle past `claimIdleMs`, and dead-lettered after `maxDeliveries`.
 * Up to `concurrency` handlers run at once; more are read as slots free up.
 */
export function createStreamWorker(
  { redis, log }: { redis: RedisClient; log: Logger },
  options: StreamWorkerOptions,
  handler: MessageHandler,
): StreamWorker {
  // XREADGROUP BLOCK occupies its connection; acks and heartbeats must not queue behind it.
  const blocking = redis.duplicate();
  blocking.on("error", () => {});
  const names: QueueNames = { stream: options.stream, dead: options.dead, group: options.group };
  const blockMs = options.blockMs ?? 1_000;
  const heartbeatMs = options.heartbeatMs ?? Math.max(50, Math.floor(options.claimIdleMs / 4));
  const graceMs = options.graceMs ?? 5_000;
  const events = options.events ?? {};
  // Every message this consumer holds and has not yet acked, with its task.
  const inFlight = new Map<string, Promise<void>>();
  // The subset whose handler is still running: these use up concurrency slots.
  const running = new Set<string>();
  const handlerAbort = new AbortController();
  let cursor = "0-0";
  let groupReady = false;
  let slotFreed: (() => void) | undefined;
  // Set by runOnce when the gate had no permits: how long to wait before asking again.
  let gateWaitMs = 0;

  // Acks that finish together share one MULTI: XACK + XDEL of all their ids.
  const ack = createBatcher<string>(async (ids) => {
    const results = await redis.multi().xack(names.stream, names.group, ...ids).xdel(names.stream, ...ids).exec();
    const failed = results?.find(([error]) => error);
    if (!results || failed) throw failed?.[0] ?? new Error("ack transaction aborted");
    return ids.map(() => undefined);
  });

  const release = (id: string) => {
    if (!running.delete(id)) return;
    events.inFlight?.(running.size);
    slotFreed?.();
  };
  const settle = (id: string) => {
    release(id);
    inFlight.delete(id);
  };

  async function process(message: StreamMessage): Promise<void> {
    const started = performance.now();
    const msgLog = log.child({ msg_id: message.id, job_id: message.fields.job_id, tenant: message.fields.tenant });
    if (message.deliveries > options.maxDeliveries) {
      const reason = `exceeded ${options.maxDeliveries} deliveries`;
      await deadLetter(redis, names, message, reason, options.onDeadLetter);
      events.deadLettered?.(message, reason);
      msgLog.warn("message_dead_lettered", { reason, deliveries: message.deliveries });
      return;
    }
    try {
      await handler(message, handlerAbort.signal);
    } catch (error) {
      if (error instanceof PermanentJobError) {
        const reason = `permanent: ${error.message}`;
        await deadLetter(redis, names, message, reason, options.onDeadLetter);
        events.deadLettered?.(message, reason);
        msgLog.warn("message_dead_lettered", { reason, deliveries: message.deliveries });
        return;
      }
      // Leave it pending: XAUTOCLAIM redelivers it after claimIdleMs, which
      // doubles as a coarse backoff between deliveries.
      events.failed?.(message, error);
      msgLog.warn("message_failed", { deliveries: message.deliveries, error });
      return;
    }
    // The slot is free once the work is committed; the ack can finish in the background.
    release(message.id);
    // Ack only after the handler's effects are committed. XDEL keeps the
    // stream bounded without MAXLEN, which could trim pending entries.
    await ack(message.id);
    events.acked?.(message, performance.now() - started);
  }

  function start(message: StreamMessage, source: "new" | "reclaimed") {
    events.delivered?.(message, source);
    const task = process(message)
      .catch((error) => log.error("message_processing_error", { msg_id: message.id, error }))
      .finally(() => settle(message.id));
    running.add(message.id);
    inFlight.set(message.id, task);
    events.inFlight?.(running.size);
  }

  async function reclaim(count: number): Promise<StreamMessage[]> {
    const [next, entries] = await redis.xautoclaim(
      names.stream,
      names.group,
      options.consumer,
      options.claimIdleMs,
      cursor,
      "COUNT",
      count,
    ) as [string, RawEntry[], string[]];
    // Keep the cursor, or every call rescans the PEL from 0-0.
    cursor = next;
    const live = entries.filter((e): e is [string, string[]] => e[1] !== null && !inFlight.has(e[0]));
    if (live.length === 0) return [];
    // XAUTOCLAIM bumped each delivery count; read the counts back from the PEL.
    const counts = new Map<string, number>();
    const ids = live.map(([id]) => id);
    const pending = await redis.xpending(
      names.stream,
      names.group,
      ids[0]!,
      ids[ids.length - 1]!,
      // Our in-flight entries may sit in the same id range; ask for enough rows to cover them too.
      ids.length + inFlight.size,
      options.consumer,
    ) as [string, string, number, number][];
    for (const [id, , , times] of pending) counts.set(id, times);
    return live.map(([id, flat]) => ({ id, fields: fieldsToObject(flat), deliveries: counts.get(id) ?? 2 }));
  }

  async function readNew(count: number, block: number): Promise<StreamMessage[]> {
    const args: (string | number)[] = ["GROUP", names.group, options.consumer, "COUNT", count];
    if (block > 0) args.push("BLOCK", block);
    args.push("STREAMS", names.stream, ">");
    const reply = await blocking.call("XREADGROUP", ...args) as [string, RawEntry[]][] | null;
    const entries = reply?.[0]?.[1] ?? [];
    // A new message has been delivered exactly once.
    return entries.filter((e): e is [string, string[]] => e[1] !== null)
      .map(([id, flat]) => ({ id, fields: fieldsToObject(flat), deliveries: 1 }));
  }

  async function runOnce(block = blockMs): Promise<number> {
    if (!groupReady) {
      await ensureGroup(redis, names);
      groupReady = true;
    }
    let free = options.concurrency - running.size;
    if (free <= 0) return 0;
    gateWaitMs = 0;
    if (options.gate) {
      const { permits, waitMs } = await options.gate();
      if (permits <= 0) {
        gateWaitMs = Math.max(1, waitMs);
        return 0;
      }
      free = Math.min(free, permits);
    }
    const reclaimed = await reclaim(free);
    for (const m of reclaimed) start(m, "reclaimed");
    free -= reclaimed.length;
    let started = reclaimed.length;
    if (free > 0) {
      const fresh = await readNew(free, reclaimed.length > 0 ? 0 : block);
      for (const m of fresh) start(m, "new");
      started += fresh.length;
    }
    return started;
  }

  async function heartbeat(): Promise<string[]> {
    const ids = [...inFlight.keys()];
    if (ids.length === 0) return [];
    const refreshed = await HEARTBEAT.run(redis, [names.stream], [names.group, options.consumer, ...ids]) as string[];
    if (refreshed.length < ids.length) {
      const lost = ids.filter((id) => !refreshed.includes(id));
      log.warn("messages_reclaimed_by_another_consumer", { msg_ids: lost });
    }
    return refreshed;
  }

  const pruneIdleMs = options.pruneIdleMs ?? Math.max(3 * options.claimIdleMs, 60_000);
  async function pruneConsumers(): Promise<string[]> {
    const consumers = await redis.call("XINFO", "CONSUMERS", names.stream, names.group) as unknown[][];
    const removed: string[] = [];
    for (const c of consumers) {
      const f = new Map<string, unknown>();
      for (let i = 0; i + 1 < c.length; i += 2) f.set(String(c[i]), c[i + 1]);
      const name = String(f.get("name"));
      // Only consumers with an empty PEL: deleting one that holds messages would drop them from the PEL.
      if (name === options.consumer || Number(f.get("pending")) !== 0 || Number(f.get("idle")) < pruneIdleMs) continue;
      await redis.xgroup("DELCONSUMER", names.stream, names.group, name);
      removed.push(name);
    }
    if (removed.length) log.info("consumers_pruned", { consumers: removed });
    return removed;
  }

  async function drain(): Promise<void> {
    await Promise.all(inFlight.values());
  }

  async function run(signal: AbortSignal): Promise<void> {
    const beat = setInterval(() => {
      heartbeat().catch((error) => log.warn("heartbeat_failed", { error }));
    }, heartbeatMs);
    const prune = setInterval(() => {
      pruneConsumers().catch((error) => log.warn("consumer_prune_failed", { error }));
    }, Math.min(pruneIdleMs, 60_000));
    const wake = () => slotFreed?.();
    signal.addEventListener("abort", wake);
    try {
      while (!signal.aborted) {
        if (running.size >= options.concurrency) {
          await new Promise<void>((resolve) => (slotFreed = resolve));
          slotFreed = undefined;
          continue;
        }
        try {
          await runOnce(Math.min(blockMs, 1_000));
          if (gateWaitMs > 0) await sleep(Math.min(gateWaitMs, 1_000), signal).catch(() => {});
        } catch (error) {
          if (signal.aborted) break;
          log.warn("worker_read_failed", { error });
          await sleep(500, signal).catch(() => {});
        }
      }
      // Stop reading; let in-flight handlers finish within the grace period.
      if (!(await settlesWithin(drain(), graceMs))) {
        // Abandoned messages stay pending and are reclaimed by another worker.
        log.warn("worker_abandoned_in_flight", { count: running.size });
        handlerAbort.abort(new Error("worker stopping"));
        await settlesWithin(drain(), 500);
      }
    } finally {
      clearInterval(beat);
      clearInterval(prune);
      signal.removeEventListener("abort", wake);
    }
  }

  return {
    runOnce,
    run,
    drain,
    heartbeat,
    pruneConsumers,
    get inFlight() {
      return running.size;
    },
    async close() {
      handlerAbort.abort(new Error("worker closed"));
      await blocking.quit().catch(() => blocking.disconnect());
    },
  };
}
