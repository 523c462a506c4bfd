import type { RedisClient } from "../clients.ts";
import { createBatcher } from "../async/batcher.ts";
import { settlesWithin, sleep } from "../async/timeout.ts";
import type { Logger } from "../log/logger.ts";
import { defineScript } from "../redis/script.ts";
import { deadLetter, type DeadLetterHook } from "./dead_letter.ts";
import { PermanentJobError } from "./errors.ts";
import { createLaneShares, type LaneCharge, type LaneSource } from "./lanes.ts";
import { fieldsToObject, type QueueNames, type StreamMessage } from "./message.ts";

/** Handles one message. Resolve to acknowledge; throw to leave it pending for redelivery. */
export type MessageHandler = (message: StreamMessage, signal: AbortSignal) => Promise<unknown>;

/** Counters a worker reports; wire them to metrics. */
export interface WorkerEvents {
  delivered?(message: StreamMessage, source: "new" | "reclaimed"): void;
  acked?(message: StreamMessage, durationMs: number): void;
  failed?(message: StreamMessage, error: unknown): void;
  deadLettered?(message: StreamMessage, reason: string): void;
  /** The dead-letter stream's caps (length, age) dropped `count` older entries. */
  deadLettersTrimmed?(count: number): void;
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
  /**
   * Asked before a message is dead-lettered (the application decides there
   * that the job failed). `false`: the job was already decided otherwise
   * (done, cancelled), so the message is acknowledged instead; a string: the
   * reason to record instead (what the application knows of the failure).
   * Throwing leaves the message pending, to be decided on a later delivery.
   */
  beforeDeadLetter?: (message: StreamMessage, reason: string) => Promise<boolean | string>;
  events?: WorkerEvents;
  /**
   * Asked before each read: how many messages the downstream can start soon.
   * With no permits the worker reads nothing (jobs wait in the stream, not in
   * memory, and spend no delivery) and asks again after `waitMs`.
   */
  gate?: () => Promise<{ permits: number; waitMs: number }>;
  /**
   * Several streams ("lanes", one per tenant), shared fairly: each read takes
   * from the lanes with work in turn. Without it the worker reads the one
   * stream in `stream`/`dead`/`group`.
   */
  lanes?: LaneSource;
  /** With lanes: the most messages of one lane pending across all consumers (TENANT_MAX_IN_FLIGHT). */
  laneMaxInFlight?: number;
  /**
   * With lanes: what a message costs in the unit the lanes share (for summaries, its estimated tokens).
   * Each read serves the lane with the least weighted cost taken, so a lane of large messages gets fewer
   * of them. Default 1: the lanes share messages by count.
   */
  cost?: (message: StreamMessage) => number;
  /**
   * With lanes: what a message turned out to cost (tokens the provider reported), asked once when its
   * handler has finished; its lane is charged that instead of the estimate. `undefined` keeps the estimate.
   */
  spent?: (message: StreamMessage) => number | undefined;
  /**
   * With lanes: each lane's weight, 1 or more: while both have work, a lane of weight 3 gets three times the
   * share of a lane of weight 1. Asked once per read, so answer from a cache. Default: every lane weighs 1.
   */
  weights?: () => Promise<(lane: QueueNames) => number>;
}

/** Test seams: each runs at its point, and may throw or wait to stand in for a crash or a stall there. */
export interface StreamWorkerFaults {
  /** After the job was decided failed, before the dead-letter step. */
  beforeDeadLetter?(message: StreamMessage): Promise<void>;
  /** In `pruneConsumers`, after `XINFO CONSUMERS` named `consumer` as idle, before it is removed. */
  beforePrune?(consumer: string): Promise<void>;
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

// Reads up to ARGV[3] new messages for consumer ARGV[2] of group ARGV[1] on
// stream KEYS[1], but never more than leave ARGV[4] (0 = no cap) pending in
// the group across all consumers: a tenant's in-flight cap, checked and
// taken in one step. Returns {capped, entries}.
const TAKE = defineScript(`
local count = tonumber(ARGV[3])
local cap = tonumber(ARGV[4])
if cap > 0 then
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1])[1]
  count = math.min(count, cap - pending)
  if count <= 0 then return {1, {}} end
end
local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', count, 'STREAMS', KEYS[1], '>')
if not reply then return {0, {}} end
return {0, reply[1][2]}`);

// Removes consumer ARGV[2] from group ARGV[1] of stream KEYS[1] only if it still holds nothing and has been
// idle at least ARGV[3] ms, checked and done in one step: a consumer that read or reclaimed a message since
// the caller's look is left alone (XGROUP DELCONSUMER would drop its pending messages for good).
const PRUNE = defineScript(`
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local f = {}
  for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
  if f['name'] == ARGV[2] then
    if tonumber(f['pending']) ~= 0 or tonumber(f['idle']) < tonumber(ARGV[3]) then return 0 end
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
    return 1
  end
end
return 0`);

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
 * With `lanes`, every stream the lane source names is one lane with its own
 * group, reclaim, heartbeats, acks and dead letters, and free slots go to
 * the lanes with work in turn.
 */
export function createStreamWorker(
  { redis, log, faults }: { redis: RedisClient; log: Logger; faults?: StreamWorkerFaults },
  options: StreamWorkerOptions,
  handler: MessageHandler,
): StreamWorker {
  // XREADGROUP BLOCK occupies its connection; acks and heartbeats must not queue behind it.
  const blocking = options.lanes ? undefined : redis.duplicate();
  blocking?.on("error", () => {});
  const single: QueueNames = { stream: options.stream, dead: options.dead, group: options.group };
  const blockMs = options.blockMs ?? 1_000;
  const heartbeatMs = options.heartbeatMs ?? Math.max(50, Math.floor(options.claimIdleMs / 4));
  const graceMs = options.graceMs ?? 5_000;
  const events = options.events ?? {};
  // Messages are known by lane and id: two lanes' streams may use the same entry ids.
  const tag = (lane: QueueNames, id: string) => `${lane.stream}\n${id}`;
  // Every message this consumer holds and has not yet acked, with its task and lane.
  const inFlight = new Map<string, { task: Promise<void>; lane: QueueNames; id: string }>();
  // The subset whose handler is still running: these use up concurrency slots.
  const running = new Set<string>();
  const handlerAbort = new AbortController();
  const cursors = new Map<string, string>();
  const groupsReady = new Set<string>();
  let lastServed = "";
  // With lanes: who was given how much (see createLaneShares), and what each running message was charged.
  const shares = createLaneShares();
  const charges = new Map<string, { message: StreamMessage; charge?: LaneCharge }>();
  let reclaimTurn = 0;
  let lastReclaim = -Infinity;
  let slotFreed: (() => void) | undefined;
  // Set by runOnce when the gate had no permits: how long to wait before asking again.
  let gateWaitMs = 0;

  // Acks that finish together share one MULTI per lane: XACK + XDEL of their ids.
  const ack = createBatcher<{ lane: QueueNames; id: string }>(async (items) => {
    const byLane = new Map<string, { lane: QueueNames; ids: string[] }>();
    for (const { lane, id } of items) {
      const entry = byLane.get(lane.stream) ?? { lane, ids: [] };
      entry.ids.push(id);
      byLane.set(lane.stream, entry);
    }
    await Promise.all([...byLane.values()].map(async ({ lane, ids }) => {
      const results = await redis.multi().xack(lane.stream, lane.group, ...ids).xdel(lane.stream, ...ids).exec();
      const failed = results?.find(([error]) => error);
      if (!results || failed) throw failed?.[0] ?? new Error("ack transaction aborted");
    }));
    return items.map(() => undefined);
  });

  const release = (key: string) => {
    if (!running.delete(key)) return;
    const charged = charges.get(key);
    if (charged) {
      charges.delete(key);
      // What the message really cost (the provider's token count) replaces its estimate in its lane's share.
      const actual = options.spent?.(charged.message);
      if (charged.charge) shares.settle(charged.charge, actual);
    }
    events.inFlight?.(running.size);
    slotFreed?.();
  };
  const settle = (key: string) => {
    release(key);
    inFlight.delete(key);
  };

  /** Dead-letters `message`, unless its job turns out to be decided already: then acks it. */
  async function bury(lane: QueueNames, message: StreamMessage, given: string, msgLog: Logger): Promise<void> {
    const verdict = options.beforeDeadLetter ? await options.beforeDeadLetter(message, given) : true;
    const reason = typeof verdict === "string" ? verdict : given;
    if (verdict === false) {
      msgLog.info("message_already_decided", { reason, deliveries: message.deliveries });
      release(tag(lane, message.id));
      await ack({ lane, id: message.id });
      return;
    }
    await faults?.beforeDeadLetter?.(message);
    const trimmed = await deadLetter(redis, lane, message, reason, options.onDeadLetter);
    events.deadLettered?.(message, reason);
    msgLog.warn("message_dead_lettered", { reason, deliveries: message.deliveries });
    if (trimmed > 0) {
      events.deadLettersTrimmed?.(trimmed);
      log.warn("dead_letters_trimmed", { stream: lane.dead, entries: trimmed });
    }
  }

  async function process(lane: QueueNames, message: StreamMessage): Promise<void> {
    const started = performance.now();
    const msgLog = log.child({ msg_id: message.id, job_id: message.fields.job_id, tenant: message.fields.tenant });
    if (message.deliveries > options.maxDeliveries) {
      await bury(lane, message, `exceeded ${options.maxDeliveries} deliveries`, msgLog);
      return;
    }
    try {
      await handler(message, handlerAbort.signal);
    } catch (error) {
      if (error instanceof PermanentJobError) {
        await bury(lane, message, `permanent: ${error.message}`, msgLog);
        return;
      }
      // Leave it pending: XAUTOCLAIM redelivers it after claimIdleMs, which
      // doubles as a coarse backoff between deliveries.
      events.failed?.(message, error);
      msgLog.warn("message_failed", { deliveries: message.deliveries, error });
      return;
    }
    // The slot is free once the work is committed; the ack can finish in the background.
    release(tag(lane, message.id));
    // Ack only after the handler's effects are committed. XDEL keeps the
    // stream bounded without MAXLEN, which could trim pending entries.
    await ack({ lane, id: message.id });
    events.acked?.(message, performance.now() - started);
  }

  function start(lane: QueueNames, message: StreamMessage, source: "new" | "reclaimed") {
    events.delivered?.(message, source);
    const key = tag(lane, message.id);
    // Charged before the handler runs: its slot and its share are released together.
    const charge = options.lanes ? shares.charge(lane.stream, options.cost?.(message) ?? 1) : undefined;
    charges.set(key, { message, charge });
    const task = process(lane, message)
      .catch((error) => log.error("message_processing_error", { msg_id: message.id, error }))
      .finally(() => settle(key));
    running.add(key);
    inFlight.set(key, { task, lane, id: message.id });
    events.inFlight?.(running.size);
  }

  async function ready(lane: QueueNames): Promise<void> {
    if (groupsReady.has(lane.stream)) return;
    await ensureGroup(redis, lane);
    groupsReady.add(lane.stream);
  }

  async function reclaim(lane: QueueNames, count: number): Promise<StreamMessage[]> {
    await ready(lane);
    const [next, entries] = await redis.xautoclaim(
      lane.stream,
      lane.group,
      options.consumer,
      options.claimIdleMs,
      cursors.get(lane.stream) ?? "0-0",
      "COUNT",
      count,
    ) as [string, RawEntry[], string[]];
    // Keep the cursor, or every call rescans the PEL from 0-0.
    cursors.set(lane.stream, next);
    const live = entries.filter((e): e is [string, string[]] => e[1] !== null && !inFlight.has(tag(lane, e[0])));
    if (live.length === 0) return [];
    // XAUTOCLAIM bumped each delivery count; read the counts back from the PEL.
    const counts = new Map<string, number>();
    const ids = live.map(([id]) => id);
    const pending = await redis.xpending(
      lane.stream,
      lane.group,
      ids[0]!,
      ids[ids.length - 1]!,
      // Our in-flight entries may sit in the same id range; ask for enough rows to cover them too.
      ids.length + inFlight.size,
      options.consumer,
    ) as [string, string, number, number][];
    for (const [id, , , times] of pending) counts.set(id, times);
    return live.map(([id, flat]) => ({ id, fields: fieldsToObject(flat), deliveries: counts.get(id) ?? 2 }));
  }

  const toMessages = (entries: RawEntry[]) =>
    // A new message has been delivered exactly once.
    entries.filter((e): e is [string, string[]] => e[1] !== null)
      .map(([id, flat]) => ({ id, fields: fieldsToObject(flat), deliveries: 1 }));

  async function readSingle(count: number, block: number): Promise<StreamMessage[]> {
    const args: (string | number)[] = ["GROUP", single.group, options.consumer, "COUNT", count];
    if (block > 0) args.push("BLOCK", block);
    args.push("STREAMS", single.stream, ">");
    const reply = await blocking!.call("XREADGROUP", ...args) as [string, RawEntry[]][] | null;
    return toMessages(reply?.[0]?.[1] ?? []);
  }

  /** Takes from one lane, within its in-flight cap. @returns the messages, and whether the cap stopped it. */
  async function take(lane: QueueNames, count: number): Promise<{ messages: StreamMessage[]; capped: boolean }> {
    await ready(lane);
    const [capped, entries] = await TAKE.run(redis, [lane.stream], [
      lane.group,
      options.consumer,
      count,
      options.laneMaxInFlight ?? 0,
    ]) as [number, RawEntry[]];
    return { messages: toMessages(entries), capped: capped === 1 };
  }

  /**
   * Shares `free` slots between the lanes with work by weighted cost (see
   * {@linkcode createLaneShares}): each take goes to the lane furthest
   * behind, ties in turn starting one lane further on every call, so one
   * tenant's backlog never stalls another's jobs, and a tenant of large
   * documents does not take the provider's tokens from one of small ones.
   */
  async function readLanes(free: number, block: number): Promise<number> {
    const source = options.lanes!;
    const lanes = await source.active();
    let started = 0;
    let capped = false;
    if (lanes.length > 0) {
      const weightOf = options.weights ? await options.weights() : () => 1;
      shares.begin(lanes.map((lane) => ({ id: lane.stream, weight: weightOf(lane) })));
      // Round-robin order from one lane after the one served first last time. Keep asking until the free
      // slots are used or every lane has said it has no more: an empty or capped lane never leaves a slot
      // idle while another lane has work.
      const at = lanes.findIndex((l) => l.stream > lastServed);
      const first = at < 0 ? 0 : at;
      let candidates = [...lanes.slice(first), ...lanes.slice(0, first)];
      for (let asked = 0; free > 0 && candidates.length > 0; asked++) {
        const pick = shares.next(candidates.map((l) => l.stream), free);
        const lane = candidates.find((l) => l.stream === pick.lane)!;
        if (asked === 0) lastServed = lane.stream;
        let took = 0;
        try {
          const read = await take(lane, pick.count);
          capped ||= read.capped;
          if (read.messages.length === 0 && !read.capped) {
            shares.drained(lane.stream);
            await source.idle(lane);
          }
          for (const m of read.messages) start(lane, m, "new");
          took = read.messages.length;
        } catch (error) {
          // One lane's trouble (its node failing over, a lost group) must not stall the others.
          laneFailed(lane, error);
        }
        free -= took;
        started += took;
        // A lane that gave fewer than asked is empty or capped for now: not asked again in this read.
        if (took < pick.count) candidates = candidates.filter((l) => l !== lane);
      }
    }
    // Nothing to take: wait for a wake-up; a capped lane frees up as its jobs finish, so look again soon.
    if (started === 0 && block > 0) await source.wait(capped ? Math.min(block, 50) : block);
    return started;
  }

  function laneFailed(lane: QueueNames, error: unknown) {
    if (error instanceof Error && error.message.includes("NOGROUP")) groupsReady.delete(lane.stream);
    log.warn("lane_read_failed", { stream: lane.stream, error });
  }

  async function reclaimAll(free: number): Promise<number> {
    let started = 0;
    const lanes = options.lanes ? await options.lanes.all() : [single];
    // Rotate where reclaim starts, so one lane's stream of failures cannot take every pass.
    const first = lanes.length ? reclaimTurn++ % lanes.length : 0;
    for (let i = 0; i < lanes.length; i++) {
      if (free - started <= 0) break;
      const lane = lanes[(first + i) % lanes.length]!;
      try {
        const reclaimed = await reclaim(lane, free - started);
        for (const m of reclaimed) start(lane, m, "reclaimed");
        started += reclaimed.length;
      } catch (error) {
        if (!options.lanes) throw error;
        laneFailed(lane, error);
      }
    }
    return started;
  }

  async function runOnce(block = blockMs): Promise<number> {
    if (!options.lanes) await ready(single);
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
    let started = 0;
    // One lane is reclaimed on every pass; many lanes at most once per heartbeat interval.
    if (!options.lanes || performance.now() - lastReclaim >= heartbeatMs) {
      lastReclaim = performance.now();
      started = await reclaimAll(free);
      free -= started;
    }
    if (free > 0) {
      if (options.lanes) started += await readLanes(free, started > 0 ? 0 : block);
      else {
        const fresh = await readSingle(free, started > 0 ? 0 : block);
        for (const m of fresh) start(single, m, "new");
        started += fresh.length;
      }
    }
    return started;
  }

  async function heartbeat(): Promise<string[]> {
    if (inFlight.size === 0) return [];
    const byLane = new Map<string, { lane: QueueNames; ids: string[] }>();
    for (const { lane, id } of inFlight.values()) {
      const entry = byLane.get(lane.stream) ?? { lane, ids: [] };
      entry.ids.push(id);
      byLane.set(lane.stream, entry);
    }
    const refreshed: string[] = [];
    for (const { lane, ids } of byLane.values()) {
      const ok = await HEARTBEAT.run(redis, [lane.stream], [lane.group, options.consumer, ...ids]) as string[];
      refreshed.push(...ok);
      if (ok.length < ids.length) {
        const lost = ids.filter((id) => !ok.includes(id));
        log.warn("messages_reclaimed_by_another_consumer", { stream: lane.stream, msg_ids: lost });
      }
    }
    return refreshed;
  }

  const pruneIdleMs = options.pruneIdleMs ?? Math.max(3 * options.claimIdleMs, 60_000);
  async function pruneConsumers(): Promise<string[]> {
    const removed: string[] = [];
    for (const lane of options.lanes ? await options.lanes.all() : [single]) {
      let consumers: unknown[][];
      try {
        await ready(lane);
        consumers = await redis.call("XINFO", "CONSUMERS", lane.stream, lane.group) as unknown[][];
      } catch (error) {
        if (!options.lanes) throw error;
        laneFailed(lane, error);
        continue;
      }
      for (const c of consumers) {
        const f = new Map<string, unknown>();
        for (let i = 0; i + 1 < c.length; i += 2) f.set(String(c[i]), c[i + 1]);
        const name = String(f.get("name"));
        // Only consumers with an empty PEL: deleting one that holds messages would drop them from the PEL.
        if (name === options.consumer || Number(f.get("pending")) !== 0 || Number(f.get("idle")) < pruneIdleMs) {
          continue;
        }
        await faults?.beforePrune?.(name);
        if ((await PRUNE.run(redis, [lane.stream], [lane.group, name, pruneIdleMs])) === 1) removed.push(name);
      }
    }
    if (removed.length) log.info("consumers_pruned", { consumers: removed });
    return removed;
  }

  async function drain(): Promise<void> {
    await Promise.all([...inFlight.values()].map((f) => f.task));
  }

  /** Waits up to `ms`, or until a handler finishes or `signal` aborts. */
  function untilSlotFreed(ms: number, signal: AbortSignal): Promise<void> {
    if (signal.aborted) return Promise.resolve();
    return new Promise<void>((resolve) => {
      const done = () => {
        clearTimeout(timer);
        if (slotFreed === done) slotFreed = undefined;
        resolve();
      };
      const timer = setTimeout(done, ms);
      slotFreed = done;
    });
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
          // A job that finishes meanwhile may give back tokens its permit reserved: ask again then.
          if (gateWaitMs > 0) await untilSlotFreed(Math.min(gateWaitMs, 1_000), signal);
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
      await blocking?.quit().catch(() => blocking.disconnect());
    },
  };
}
