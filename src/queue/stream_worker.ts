/**
 * The stream worker: one consumer reading lanes (a group on one or more
 * streams per tenant, read in the lane's order) with at-least-once
 * delivery. It is a loop that starts handlers in free slots, and the
 * services it runs beside that loop, each in a module of its own: the
 * reader (`lane_reader.ts`), the reclaimer (`reclaimer.ts`), the heartbeat
 * (`heartbeat.ts`), the consumer pruner (`consumer_pruner.ts`) and the ack
 * batcher (`ack_batcher.ts`).
 */
import type { RedisClient } from "../clients.ts";
import { settlesWithin, sleep } from "../async/timeout.ts";
import type { Logger } from "../log/logger.ts";
import { type AckItem, createAckBatcher } from "./ack_batcher.ts";
import { createGroupCache } from "./consumer_group.ts";
import { createConsumerPruner, pruneIdle } from "./consumer_pruner.ts";
import { deadLetter, type DeadLetterHook } from "./dead_letter.ts";
import { JobDeferred, PermanentJobError } from "./errors.ts";
import { priorDeliveries, requeue } from "./requeue.ts";
import { createHeartbeat, heartbeatInterval } from "./heartbeat.ts";
import { createLaneReader } from "./lane_reader.ts";
import { createLaneShares, type LaneCharge, type LaneShares } from "./lane_shares.ts";
import type { LaneSource } from "./lanes.ts";
import { laneId, type LaneNames, type QueueNames, type StreamMessage } from "./message.ts";
import { createReclaimer } from "./reclaimer.ts";

export { ensureGroup } from "./consumer_group.ts";

/**
 * Handles one message. Resolve to acknowledge; throw to leave it pending for redelivery. A handler may call
 * `finishing()` once only its last, short step is left (the summary job: its commit, after the model call): it
 * then gives its slot to the next message (at most `concurrency` handlers finish without one), and the worker
 * reads one more message ahead, to wait for the next slot that frees.
 */
export type MessageHandler = (message: StreamMessage, signal: AbortSignal, finishing: () => void) => Promise<unknown>;

/** Counters a worker reports; wire them to metrics. */
export interface WorkerEvents {
  delivered?(message: StreamMessage, source: "new" | "reclaimed"): void;
  acked?(message: StreamMessage, durationMs: number): void;
  failed?(message: StreamMessage, error: unknown): void;
  deadLettered?(message: StreamMessage, reason: string): void;
  /** The message went back to the end of its lane (a {@linkcode JobDeferred}), without spending a delivery. */
  deferred?(message: StreamMessage, reason: string): void;
  /** The dead-letter stream's caps (length, age) dropped `count` older entries. */
  deadLettersTrimmed?(count: number): void;
  inFlight?(count: number): void;
}

/** Defaults of {@linkcode createStreamWorker}. */
export const STREAM_WORKER_DEFAULTS = {
  /** How long one read waits for new messages when every lane is empty. */
  blockMs: 1_000,
  /** The longest one read of the `run` loop waits, whatever `blockMs` says, so a stop is seen soon. */
  maxLoopBlockMs: 1_000,
  /** Time in-flight handlers get to finish after stop; the rest stay pending. */
  graceMs: 5_000,
  /** After the grace period, the time aborted handlers get to settle. */
  abortedSettleMs: 500,
  /** The pause after a failed read before the loop reads again. */
  readRetryMs: 500,
  /** The longest wait for the gate's permits before it is asked again (a finished job may give some back). */
  maxGateWaitMs: 1_000,
  /** The wait before asking the gate again when the permits it has are all for messages read ahead. */
  readAheadGateWaitMs: 50,
} as const;

/** Options for {@linkcode createStreamWorker}. */
export interface StreamWorkerOptions {
  /**
   * The lanes (a group on one or more streams per tenant, read in the lane's order), shared fairly: each read
   * takes from the lanes with work in turn. Fixed lanes without a registry are {@linkcode staticLanes}.
   */
  lanes: LaneSource;
  /** Unique per process: host + pid + random. */
  consumer: string;
  /** Idle time after which another consumer may reclaim a pending message. */
  claimIdleMs: number;
  /** Deliveries allowed before a message is dead-lettered. */
  maxDeliveries: number;
  /**
   * Handlers running at once in this process before they say they are finishing (see {@linkcode MessageHandler}):
   * for the summary job, model calls in flight. As many more may be finishing without a slot.
   */
  concurrency: number;
  /** How long one read waits for new messages; default `STREAM_WORKER_DEFAULTS.blockMs`. */
  blockMs?: number;
  /** How often in-flight messages' idle time is refreshed; default `claimIdleMs / 4` (`HEARTBEAT_DEFAULTS`). */
  heartbeatMs?: number;
  /** The least time between two reclaim passes over the lanes; default the heartbeat interval. */
  reclaimIntervalMs?: number;
  /** Time in-flight handlers get to finish after stop; the rest stay pending. */
  graceMs?: number;
  /**
   * Consumers idle this long with nothing pending are removed from the group
   * (each process restart adds a consumer name). Default `max(3 × claimIdleMs, 60 s)` (`PRUNER_DEFAULTS`).
   */
  pruneIdleMs?: number;
  onDeadLetter?: DeadLetterHook;
  /**
   * A record (in the lane's hash tag) whose lifetime starts when a message is acknowledged: it is given `ttlS` in
   * the ack's own MULTI (a job's status record, which does not expire while its job is queued). `stream`: the
   * stream of its lane the message came from.
   */
  expireOnAck?: (stream: QueueNames, message: StreamMessage) => { key: string; ttlS: number } | undefined;
  /**
   * Asked before a message is dead-lettered (the application decides there
   * that the job failed). `false`: the job was already decided otherwise
   * (done, cancelled), so the message is acknowledged instead; a string: the
   * reason to record instead (what the application knows of the failure).
   * Throwing leaves the message pending, to be decided on a later delivery.
   */
  beforeDeadLetter?: (message: StreamMessage, reason: string) => Promise<boolean | string>;
  /** Lanes not to read new messages from for now (a tenant whose budget is spent). */
  skip?: (lane: LaneNames) => boolean;
  /**
   * Told of each message read ahead, which waits for a slot (see {@linkcode MessageHandler}): its handler may
   * start then what it can do before it runs.
   */
  readAhead?: (message: StreamMessage) => void;
  /** After a deferred message went back to the end of its stream (to wake whoever may take it). */
  onDeferred?: (stream: QueueNames, message: StreamMessage, error: JobDeferred) => Promise<void>;
  /** After a stop, a message read ahead and never started went back to the end of its stream (no delivery spent). */
  onHandedBack?: (stream: QueueNames, message: StreamMessage) => Promise<void>;
  events?: WorkerEvents;
  /**
   * Asked before each read: how many messages the downstream can start soon.
   * With no permits the worker reads nothing (jobs wait in the stream, not in
   * memory, and spend no delivery) and asks again after `waitMs`.
   */
  gate?: () => Promise<{ permits: number; waitMs: number }>;
  /** The most messages of one lane pending across all consumers (TENANT_MAX_IN_FLIGHT). */
  laneMaxInFlight?: number;
  /**
   * What a message costs in the unit the lanes share (for summaries, its estimated tokens).
   * Each read serves the lane with the least weighted cost taken, so a lane of large messages gets fewer
   * of them. Default 1: the lanes share messages by count.
   */
  cost?: (message: StreamMessage) => number;
  /**
   * What a message turned out to cost (tokens the provider reported), asked once when its handler has
   * finished; its lane is charged that instead of the estimate. `undefined` keeps the estimate.
   */
  spent?: (message: StreamMessage) => number | undefined;
  /**
   * Each lane's weight, 1 or more: while both have work, a lane of weight 3 gets three times the share of a
   * lane of weight 1. Asked once per read, so answer from a cache. Default: every lane weighs 1.
   */
  weights?: () => Promise<(lane: LaneNames) => number>;
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
  /**
   * One iteration: reclaim idle messages, read new ones into free slots (and for finishing handlers' slots, read
   * ahead), start their handlers. @returns how many were taken.
   */
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
  /** Aborts running handlers; the worker opens no connection of its own, so that is all there is to close. */
  close(): Promise<void>;
}

/**
 * Creates a consumer-group worker with at-least-once delivery: messages are
 * acknowledged only after their handler resolves, reclaimed with XAUTOCLAIM
 * when idle past `claimIdleMs`, and dead-lettered after `maxDeliveries`.
 * Up to `concurrency` handlers run at once; more are read as slots free up.
 * Every lane the lane source names has its own group on each of its streams,
 * read in the lane's order, with reclaim, heartbeats, acks and dead letters
 * stream by stream; free slots go to the lanes with work in turn.
 */
export function createStreamWorker(
  { redis, log, faults }: { redis: RedisClient; log: Logger; faults?: StreamWorkerFaults },
  options: StreamWorkerOptions,
  handler: MessageHandler,
): StreamWorker {
  const { consumer, lanes } = options;
  const blockMs = options.blockMs ?? STREAM_WORKER_DEFAULTS.blockMs;
  const heartbeatMs = heartbeatInterval(options.claimIdleMs, options.heartbeatMs);
  const events = options.events ?? {};
  const shares = createLaneShares();
  // What the message really cost (the provider's token count) replaces its estimate in its lane's share.
  const slots = createSlots(
    options,
    (message, charge) => shares.settle(charge, options.spent?.(message)),
    // A lane due before a message read ahead (one that got work since it was read) takes the freed slot first.
    shares,
  );
  const groups = createGroupCache({ redis, log });
  const reader = createLaneReader({ redis }, { ...options, groups, shares });
  const reclaimer = createReclaimer({ redis }, {
    consumer,
    claimIdleMs: options.claimIdleMs,
    // Many lanes are reclaimed at most once per heartbeat interval, not on every read.
    intervalMs: options.reclaimIntervalMs ?? heartbeatMs,
    lanes,
    groups,
    holds: (stream, id) => slots.holds(stream, id),
    held: () => slots.heldCount(),
  });
  const heartbeat = createHeartbeat({ redis, log }, { consumer, intervalMs: heartbeatMs, held: () => slots.held() });
  const pruner = createConsumerPruner({ redis, log }, {
    consumer,
    lanes,
    groups,
    idleMs: pruneIdle(options.claimIdleMs, options.pruneIdleMs),
    beforePrune: faults?.beforePrune,
  });
  const handlerAbort = new AbortController();
  const processMessage = createMessageProcessor({ redis, log, faults }, options, handler, {
    ack: createAckBatcher(redis),
    release: (stream, id) => slots.release(stream, id),
    signal: handlerAbort.signal,
  });
  // Set by runOnce when the gate had no permits: how long to wait before asking again.
  let gateWaitMs = 0;

  function start(lane: LaneNames, stream: QueueNames, message: StreamMessage, source: "new" | "reclaimed") {
    events.delivered?.(message, source);
    // Charged before the handler runs: its slot and its share are released together.
    const charge = shares.charge(laneId(lane), options.cost?.(message) ?? 1);
    slots.occupy(stream, message, charge, (settle, finishing) =>
      processMessage(stream, message, finishing)
        .catch((error) => log.error("message_processing_error", { msg_id: message.id, error }))
        .finally(settle));
  }
  const startNew = (lane: LaneNames, stream: QueueNames, m: StreamMessage) => start(lane, stream, m, "new");
  const startReclaimed = (lane: LaneNames, stream: QueueNames, m: StreamMessage) => start(lane, stream, m, "reclaimed");

  async function runOnce(block = blockMs): Promise<number> {
    let started = 0;
    try {
      return started = await readOnce(block);
    } finally {
      // Messages read ahead take the slots the read left free: those a lane with work is due before wait for the
      // next read, unless this one started nothing (that lane was capped or empty after all).
      slots.fill(started === 0);
    }
  }

  async function readOnce(block: number): Promise<number> {
    let free = slots.wanted();
    if (free <= 0) return 0;
    gateWaitMs = 0;
    let lanes: Promise<void> | undefined;
    if (options.gate) {
      // The lanes with work are looked up beside the gate: a read waits for one round trip before its take, not two.
      lanes = reader.lanes();
      lanes.catch(() => {}); // observed by the read; none when the gate says no
      const { permits, waitMs } = await options.gate();
      // Messages read ahead will ask for their permits as soon as they start: they count as waiting already.
      const usable = permits - slots.readAhead();
      if (usable <= 0) {
        gateWaitMs = Math.max(1, permits > 0 ? STREAM_WORKER_DEFAULTS.readAheadGateWaitMs : waitMs);
        return 0;
      }
      free = Math.min(free, usable);
    }
    let started = await reclaimer.reclaim(free, startReclaimed);
    free -= started;
    // A slot held for a lane due before the messages read ahead waits for this read: the read must not block.
    const wait = started > 0 || slots.deferred() ? 0 : block;
    if (free > 0) started += await reader.read(free, wait, startNew, lanes);
    return started;
  }

  return {
    runOnce,
    run: (signal) =>
      runUntilStopped({ redis, log }, options, {
        slots,
        services: [heartbeat, pruner],
        runOnce,
        gateWaitMs: () => gateWaitMs,
        abortHandlers: () => handlerAbort.abort(new Error("worker stopping")),
      }, signal),
    drain: () => slots.drain(),
    heartbeat: () => heartbeat.beat(),
    pruneConsumers: () => pruner.prune(),
    get inFlight() {
      return slots.running();
    },
    close() {
      slots.abandonReadAhead();
      handlerAbort.abort(new Error("worker closed"));
      return Promise.resolve();
    },
  };
}

/** What {@linkcode runUntilStopped} drives: the worker's slots, the services beside its loop, and its read. */
interface WorkerLoop {
  slots: Slots;
  /** Started with the loop and stopped with it (the heartbeat, the consumer pruner). */
  services: { start(): () => void }[];
  runOnce(block: number): Promise<number>;
  /** Set by the last `runOnce` when the gate had no permits: how long to wait before asking again (0: none). */
  gateWaitMs(): number;
  /** Aborts the running handlers (a stop past its grace). */
  abortHandlers(): void;
}

/** The worker's `run`: reads until `signal` aborts, then hands back what it read ahead and drains within the grace. */
async function runUntilStopped(
  { redis, log }: { redis: RedisClient; log: Logger },
  options: StreamWorkerOptions,
  { slots, services, runOnce, gateWaitMs, abortHandlers }: WorkerLoop,
  signal: AbortSignal,
): Promise<void> {
  const blockMs = options.blockMs ?? STREAM_WORKER_DEFAULTS.blockMs;
  const graceMs = options.graceMs ?? STREAM_WORKER_DEFAULTS.graceMs;
  const stops = services.map((service) => service.start());
  // From the stop on, no message starts: those a read still in flight returns wait read ahead, and go back too.
  const wake = () => {
    slots.stopping();
    slots.wake();
  };
  signal.addEventListener("abort", wake);
  try {
    while (!signal.aborted) {
      if (slots.wanted() <= 0) {
        await slots.freed(Infinity, signal);
        continue;
      }
      try {
        await runOnce(Math.min(blockMs, STREAM_WORKER_DEFAULTS.maxLoopBlockMs));
        // A job that finishes meanwhile may give back tokens its permit reserved: ask again then.
        const waitMs = gateWaitMs();
        if (waitMs > 0) await slots.freed(Math.min(waitMs, STREAM_WORKER_DEFAULTS.maxGateWaitMs), signal);
      } catch (error) {
        if (signal.aborted) break;
        log.warn("worker_read_failed", { error });
        await sleep(STREAM_WORKER_DEFAULTS.readRetryMs, signal).catch(() => {});
      }
    }
    // Stop reading. Messages read ahead never start now: each goes back to the end of its stream at once (no
    // delivery spent), so no model call begins after the stop and another worker can take it without waiting
    // for a reclaim. Then let the running handlers finish within the grace period.
    // The hand-back is bounded by the grace period too (a Redis that does not answer must not hold the stop):
    // a message it could not put back stays pending for this consumer and is reclaimed by another worker.
    const graceEnd = performance.now() + graceMs;
    await settlesWithin(handBack({ redis, log }, options, slots.abandonReadAhead()), graceMs);
    if (!(await settlesWithin(slots.drain(), Math.max(0, graceEnd - performance.now())))) {
      // Abandoned messages stay pending and are reclaimed by another worker.
      log.warn("worker_abandoned_in_flight", { count: slots.running() + slots.readAhead() });
      slots.abandonReadAhead();
      abortHandlers();
      await settlesWithin(slots.drain(), STREAM_WORKER_DEFAULTS.abortedSettleMs);
    }
  } finally {
    for (const stop of stops) stop();
    signal.removeEventListener("abort", wake);
  }
}

/** Puts messages read ahead and never started back at the end of their streams; one that fails stays pending. */
async function handBack(
  { redis, log }: { redis: RedisClient; log: Logger },
  options: Pick<StreamWorkerOptions, "consumer" | "onHandedBack">,
  entries: { stream: QueueNames; message: StreamMessage }[],
): Promise<void> {
  if (entries.length === 0) return;
  let handedBack = 0;
  await Promise.all(entries.map(async ({ stream, message }) => {
    try {
      if (await requeue(redis, stream, message, options.consumer) === null) return;
      handedBack++;
      await options.onHandedBack?.(stream, message);
    } catch (error) {
      // Still pending for this consumer: another worker reclaims it after claimIdleMs.
      log.warn("worker_hand_back_failed", { msg_id: message.id, job_id: message.fields.job_id, error });
    }
  }));
  log.info("worker_handed_back", { read_ahead: entries.length, requeued: handedBack });
}

/** The slots of one worker (see {@linkcode createSlots}). */
type Slots = ReturnType<typeof createSlots>;

/**
 * The worker's slots: every message this consumer holds and has not yet acked (heartbeats keep those), the
 * handlers running, and the slots they use up. A handler holds a slot until it says it is finishing (only a short
 * last step left: the summary job's commit, after its model call) or ends; so at most `concurrency` handlers are
 * before that point, and at most `concurrency` more past it (a finishing handler keeps its slot while as many
 * already finish without one). For each handler finishing without its slot, one message may be read ahead: it
 * waits here, held, and starts the moment a slot frees. Messages are known by stream and id: two streams
 * may use the same entry ids.
 */
function createSlots(
  options: Pick<StreamWorkerOptions, "events" | "concurrency" | "readAhead">,
  released: (message: StreamMessage, charge: LaneCharge) => void,
  order: Pick<LaneShares, "behind" | "startOf">,
) {
  const tag = (stream: QueueNames, id: string) => `${stream.stream}\n${id}`;
  const held = new Map<string, { task: Promise<void>; stream: QueueNames; id: string }>();
  // Every running handler, and which of them hold a slot.
  const handlers = new Map<string, { message: StreamMessage; charge: LaneCharge }>();
  const slotted = new Set<string>();
  // Running handlers past `finishing`, without a slot; and those that kept theirs because as many were.
  const unslotted = new Set<string>();
  const refused = new Set<string>();
  const readAhead = createReadAhead(order);
  let changed: (() => void) | undefined;
  const inFlight = () => options.events?.inFlight?.(handlers.size);
  /**
   * A slot is free: the first message read ahead takes it, unless a lane is due before it (a tenant whose first job
   * came while every slot was busy): then the worker's next read fills the slot, and `fill` after it starts the
   * messages read ahead for the slots the read left free.
   */
  let stopping = false;
  const room = () => !stopping && slotted.size < options.concurrency;
  const freeSlot = (key: string) => {
    slotted.delete(key);
    readAhead.start(room, false);
  };
  const release = (key: string) => {
    const entry = handlers.get(key);
    if (!entry) return;
    handlers.delete(key);
    refused.delete(key);
    if (slotted.has(key)) freeSlot(key);
    if (unslotted.delete(key)) {
      // Room to finish without a slot: the first handler that had to keep its slot gives it up now.
      const next = refused.values().next();
      if (!next.done) {
        refused.delete(next.value);
        unslotted.add(next.value);
        freeSlot(next.value);
      }
    }
    released(entry.message, entry.charge);
    inFlight();
    changed?.();
  };
  const finishing = (key: string) => {
    if (!slotted.has(key) || refused.has(key)) return;
    if (unslotted.size >= options.concurrency) {
      refused.add(key);
      return;
    }
    unslotted.add(key);
    freeSlot(key);
    changed?.();
  };
  return {
    /** Handlers running, with a slot or finishing without one. */
    running: () => handlers.size,
    /** How many messages a read may take now: one per free slot, and one per handler finishing without a slot. */
    wanted: () => Math.max(0, options.concurrency - slotted.size) + Math.max(0, unslotted.size - readAhead.length),
    /** Messages read ahead, not started yet. */
    readAhead: () => readAhead.length,
    /** Whether a slot is free while messages are read ahead: held for a lane due before them (see `freeSlot`). */
    deferred: () => room() && readAhead.length > 0,
    heldCount: () => held.size,
    held: (): AckItem[] => [...held.values()].map(({ stream, id }) => ({ stream, id })),
    holds: (stream: QueueNames, id: string) => held.has(tag(stream, id)),
    /**
     * Runs `message`'s handler in a slot, at once if one is free, else as soon as one frees (it was read ahead).
     * `run` calls `settle` once it is done, and may call `finishing` before.
     */
    occupy(
      stream: QueueNames,
      message: StreamMessage,
      charge: LaneCharge,
      run: (settle: () => void, finishing: () => void) => Promise<void>,
    ) {
      const key = tag(stream, message.id);
      const go = () => {
        handlers.set(key, { message, charge });
        slotted.add(key);
        inFlight();
        return run(() => {
          release(key);
          held.delete(key);
        }, () => finishing(key));
      };
      // Messages read ahead that are due before this one (they waited for this read: see `freeSlot`) start first.
      readAhead.startBefore(charge, room);
      if (room()) {
        held.set(key, { task: go(), stream, id: message.id });
        return;
      }
      options.readAhead?.(message);
      // Abandoned (a stop past its grace): never started, it stays pending for another worker to reclaim.
      const task = new Promise<void>((resolve) =>
        readAhead.push({
          stream,
          message,
          charge,
          start: () => void go().then(resolve),
          abandon: () => {
            held.delete(key);
            released(message, charge);
            resolve();
          },
        })
      );
      held.set(key, { task, stream, id: message.id });
    },
    /**
     * Starts messages read ahead in the free slots: with `force`, every one; else those no lane with work is due
     * before (see `freeSlot`).
     */
    fill(force: boolean) {
      readAhead.start(room, force);
    },
    /** The worker is stopping: no message starts from now on (each waits read ahead, to be handed back). */
    stopping() {
      stopping = true;
    },
    /** Gives up the messages read ahead and not started (they stay pending until handed back or reclaimed). */
    abandonReadAhead(): { stream: QueueNames; message: StreamMessage }[] {
      const entries = readAhead.takeAll();
      for (const entry of entries) entry.abandon();
      return entries;
    },
    /** The handler is done (its work committed): the slot is free, though the ack may still be under way. */
    release: (stream: QueueNames, id: string) => release(tag(stream, id)),
    wake: () => changed?.(),
    /** Waits up to `ms`, or until a slot frees (a handler finishes or ends) or `signal` aborts. */
    freed(ms: number, signal: AbortSignal): Promise<void> {
      if (signal.aborted) return Promise.resolve();
      return new Promise<void>((resolve) => {
        const done = () => {
          clearTimeout(timer);
          if (changed === done) changed = undefined;
          resolve();
        };
        const timer = Number.isFinite(ms) ? setTimeout(done, ms) : undefined;
        changed = done;
      });
    },
    drain: async () => {
      await Promise.all([...held.values()].map((f) => f.task));
    },
  };
}

/** A message read ahead, waiting in the worker for a slot (see {@linkcode createSlots}). */
export interface ReadAheadEntry {
  stream: QueueNames;
  message: StreamMessage;
  charge: LaneCharge;
  start(): void;
  abandon(): void;
}

/**
 * The messages read ahead, in the order of their start tags now (the order fair shares put them in): each starts
 * (or is abandoned) once. `behind(charge)`: whether a lane with work is due before a message so charged;
 * `startOf(charge)`: its start tag now. A lane's tags move together as its jobs settle (see `LaneShares.startOf`),
 * so each lane's messages wait in a queue of their own, in the order they were read, and the next to start is
 * the queue head with the earliest tag now: a look at each lane with messages read ahead, not at every message.
 */
export function createReadAhead({ behind, startOf }: Pick<LaneShares, "behind" | "startOf">) {
  const lanes = new Map<string, ReadAheadEntry[]>();
  let length = 0;
  /** The lane whose first message is due first now (ties: the lane that has waited longest), or undefined. */
  const next = (): ReadAheadEntry[] | undefined => {
    let best: ReadAheadEntry[] | undefined;
    let bestStart = Infinity;
    for (const queue of lanes.values()) {
      const start = startOf(queue[0]!.charge);
      if (start < bestStart) [best, bestStart] = [queue, start];
    }
    return best;
  };
  const take = (queue: ReadAheadEntry[]): ReadAheadEntry => {
    const entry = queue.shift()!;
    length--;
    if (queue.length === 0) lanes.delete(entry.charge.lane);
    return entry;
  };
  return {
    get length() {
      return length;
    },
    push(entry: ReadAheadEntry) {
      const queue = lanes.get(entry.charge.lane);
      if (queue) queue.push(entry);
      else lanes.set(entry.charge.lane, [entry]);
      length++;
    },
    /** Starts the first while `room()`: every one with `force`, else while no lane is due before the first. */
    start(room: () => boolean, force: boolean) {
      while (length > 0 && room()) {
        const queue = next()!;
        if (!force && behind(queue[0]!.charge)) return;
        take(queue).start();
      }
    },
    /** Starts those whose start tags are before `charge`'s, while `room()`. */
    startBefore(charge: LaneCharge, room: () => boolean) {
      const start = startOf(charge);
      while (length > 0 && room()) {
        const queue = next()!;
        if (startOf(queue[0]!.charge) >= start) return;
        take(queue).start();
      }
    },
    /** Every message read ahead, first due first. */
    takeAll(): ReadAheadEntry[] {
      const all: ReadAheadEntry[] = [];
      while (length > 0) all.push(take(next()!));
      return all;
    },
  };
}

/** Runs one message's handler and settles it: ack after commit, leave pending on failure, or dead-letter it. */
function createMessageProcessor(
  { redis, log, faults }: { redis: RedisClient; log: Logger; faults?: StreamWorkerFaults },
  options: StreamWorkerOptions,
  handler: MessageHandler,
  { ack, release, signal }: {
    ack: (item: AckItem) => Promise<void>;
    release: (stream: QueueNames, id: string) => void;
    signal: AbortSignal;
  },
): (stream: QueueNames, message: StreamMessage, finishing: () => void) => Promise<void> {
  const events = options.events ?? {};

  /** Dead-letters `message`, unless its job turns out to be decided already: then acks it. */
  async function bury(stream: QueueNames, message: StreamMessage, given: string, msgLog: Logger): Promise<void> {
    const verdict = options.beforeDeadLetter ? await options.beforeDeadLetter(message, given) : true;
    const reason = typeof verdict === "string" ? verdict : given;
    if (verdict === false) {
      msgLog.info("message_already_decided", { reason, deliveries: message.deliveries });
      release(stream, message.id);
      await ack({ stream, id: message.id, expire: options.expireOnAck?.(stream, message) });
      return;
    }
    await faults?.beforeDeadLetter?.(message);
    const trimmed = await deadLetter(redis, stream, message, reason, options.onDeadLetter);
    events.deadLettered?.(message, reason);
    msgLog.warn("message_dead_lettered", { reason, deliveries: message.deliveries });
    if (trimmed > 0) {
      events.deadLettersTrimmed?.(trimmed);
      log.warn("dead_letters_trimmed", { stream: stream.dead, entries: trimmed });
    }
  }

  return async (stream, message, finishing) => {
    const started = performance.now();
    // Made only when a line is logged: most messages log nothing here.
    const msgLog = () =>
      log.child({ msg_id: message.id, job_id: message.fields.job_id, tenant: message.fields.tenant });
    // Deliveries before a deferral count too (see `requeue.ts`).
    if (message.deliveries + priorDeliveries(message) > options.maxDeliveries) {
      await bury(stream, message, `exceeded ${options.maxDeliveries} deliveries`, msgLog());
      return;
    }
    try {
      await handler(message, signal, finishing);
    } catch (error) {
      if (error instanceof PermanentJobError) {
        await bury(stream, message, `permanent: ${error.message}`, msgLog());
        return;
      }
      if (error instanceof JobDeferred) {
        // If the requeue fails, the message stays pending and is redelivered later, as after any failure.
        const again = await requeue(redis, stream, message, options.consumer);
        release(stream, message.id);
        msgLog().info("message_deferred", { reason: error.message, requeued_as: again });
        if (again !== null) {
          events.deferred?.(message, error.message);
          await options.onDeferred?.(stream, message, error);
        }
        return;
      }
      // Leave it pending: XAUTOCLAIM redelivers it after claimIdleMs, which
      // doubles as a coarse backoff between deliveries.
      events.failed?.(message, error);
      msgLog().warn("message_failed", { deliveries: message.deliveries, error });
      return;
    }
    // The slot is free once the work is committed; the ack can finish in the background.
    release(stream, message.id);
    // Ack only after the handler's effects are committed.
    await ack({ stream, id: message.id, expire: options.expireOnAck?.(stream, message) });
    events.acked?.(message, performance.now() - started);
  };
}
