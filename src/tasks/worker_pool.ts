/**
 * A pool of child processes, or of Web Workers (`pool_channels.ts`), that run
 * tenants' work off the thread that serves requests, under a deadline: the
 * schema validators (`validator.ts`) and the definition checker
 * (`definition_checker.ts`) are both one. "Worker" below is either.
 *
 * Work waits in its tenant's queue until a Worker is free, and free Workers
 * take from the tenants' queues in turn: a tenant waits for those running and
 * at most one of each other waiting tenant's per turn, not for another
 * tenant's whole burst. Work waiting or running is capped per tenant and in
 * all; past either cap it is refused at once (`busy`). A Worker runs one piece
 * of work at a time, and each piece arms its own deadline (`PoolSlot.arm`),
 * counted from when a Worker has it: one that runs over is stopped (a child
 * process killed, a Web Worker terminated), that piece fails, and a fresh
 * Worker takes the next.
 *
 * A stopped Worker counts against the pool until nothing it ran can still be
 * running: a killed child until it is reaped (milliseconds); a Web Worker
 * until its work ends, since in Deno 2.9.6 a terminated Worker that is busy
 * goes on (`terminate()` interrupts neither a regular expression nor a loop),
 * which each Worker says in shared memory (`POOL_STATE`, kept by
 * `serveWorker` in `_pool_worker.ts`). Without that, every timeout would add
 * a thread. For Web Workers, what the work may cost, not the deadline, bounds
 * how long that is; the callers bound it.
 */
import type { PoolReply } from "./_pool_worker.ts";
import { type Channel, DEFAULT_ISOLATION, openChannel, type PoolIsolation } from "./pool_channels.ts";

/** Settings of {@linkcode createWorkerPool}. */
export interface WorkerPoolOptions<S> {
  /** The Worker's module: it calls `serveWorker` (`_pool_worker.ts`). */
  url: string;
  /** The Workers' name (in traces and errors). */
  name: string;
  /** Workers at once, counting the terminated ones still finishing their work. */
  workers: number;
  /** How long a Worker may take to load before the work waiting for it fails. */
  startMs: number;
  /**
   * How long a terminated Worker counts against the pool at most, should it never say it has finished (were it
   * ever stopped mid-work, it could not): far longer than the costliest work takes.
   */
  orphanMs: number;
  /** Work of one tenant waiting or running; past it, `busy`. */
  maxPendingPerTenant: number;
  /** Work waiting or running, all tenants together; past it, `busy`. */
  maxPending: number;
  /**
   * A pool with nothing to do for this long stops its Workers (the next piece of work starts one again, in tens
   * of ms); unset, they stay. The timer keeps no process alive, but a live Worker does.
   */
  idleMs?: number;
  /** What the Worker's `init` receives, besides the shared state. */
  init?: Record<string, unknown>;
  /** Per-Worker state of the caller's own (what it has sent this Worker, say), made with each Worker. */
  slotData: () => S;
  /** The error for work refused past a cap. */
  busy(what: string): Error;
  /** What the Workers do, in errors: "The <title> Worker failed: ..." or "... did not start within ...". */
  title: string;
  /** Child processes or Web Workers (`pool_channels.ts`); by default processes, unless this is a compiled binary. */
  isolation?: PoolIsolation;
  /** A child process's heap cap, in MiB: past it, V8 ends the child and its work fails. */
  heapMiB?: number;
  /**
   * Workers kept started, idle or not (at most `workers`): started with the pool, and again as soon as one stops,
   * so that work does not wait for a child to start when it comes (what a start costs is in the README, "Hostile
   * tenants (issue 37), measured from outside"). After a Worker failed to start or ended on its own (a crash, or
   * killed from outside the pool; not one the pool stopped), not for `keepRetryMs`, and then by a timer. None
   * unless set; a pool that keeps Workers keeps its process alive until it is closed (its live Workers do; the
   * timer of a hold-off does not).
   */
  keep?: number;
  /** How long kept Workers are held off after a Worker failed to start or ended on its own; 5 s unless set. */
  keepRetryMs?: number;
}

/** After a Worker failed to start or ended on its own, kept Workers are not started again for this long. */
const KEEP_RETRY_MS = 5_000;

/** A child process's heap cap unless the pool sets one. */
const DEFAULT_HEAP_MIB = 256;

/** The Worker running a piece of work, as that work sees it. */
export interface PoolSlot<S> {
  readonly data: S;
  /** Sends `message` to the Worker. */
  post(message: unknown): void;
  /** (Re)arms the work's deadline: in `ms`, the Worker is terminated and the work fails with `timedOut(ms)`. */
  arm(ms: number): void;
  /**
   * Asks for this Worker to be stopped once its work has settled, and a fresh one started when one is needed:
   * a Worker's heap grows with what it has compiled and never shrinks back, and a stopped one gives it all back.
   */
  retire(): void;
}

/** How a piece of work settles: a value, or an error. */
export type Settled<T> = { value: T } | { error: unknown };

/** A piece of work, as the caller of {@linkcode WorkerPool.run} describes it. */
export interface PoolWork<S, R, T> {
  /**
   * Sends the work (with its `id`, which the Worker's replies carry) and arms its deadline. Throwing (an
   * instance that cannot be cloned) means nothing reached the Worker: the work fails with that error.
   */
  begin(slot: PoolSlot<S>, id: number): void;
  /** A reply to this work: how it settles, or undefined while it goes on (re-arm or post again meanwhile). */
  reply(data: R, slot: PoolSlot<S>): Settled<T> | undefined;
  /** The error of a deadline of `ms` that ran out. */
  timedOut(ms: number): Error;
}

/** A pool; see the module. */
export interface WorkerPool<S, R> {
  /**
   * Runs `work` on a Worker in `tenant`'s turn. `signal`: the caller gives up waiting; work not begun yet leaves
   * the queue and rejects with the signal's reason (work begun runs to its own deadline).
   * @throws `busy` past a cap, at once.
   */
  run<T>(tenant: string, work: PoolWork<S, R, T>, signal?: AbortSignal): Promise<T>;
  /** Its Workers, the terminated ones still finishing their work, and the work waiting or running. */
  stats(): { workers: number; orphans: number; pending: number };
  /** Terminates the Workers; work still waiting or running rejects. Settles once their processes are reaped. */
  close(): Promise<void>;
}

interface Job<S, R> {
  id: number;
  // deno-lint-ignore no-explicit-any
  work: PoolWork<S, R, any>;
  resolve(value: unknown): void;
  reject(error: unknown): void;
}

interface Slot<S, R> {
  channel: Channel;
  ready: boolean;
  job?: Job<S, R>;
  timer?: ReturnType<typeof setTimeout>;
  handle: PoolSlot<S>;
  /** Asked to stop once its work has settled (`PoolSlot.retire`). */
  retiring: boolean;
}

/** A terminated Worker that was working: it counts against the pool until it is no longer busy. */
interface Orphan {
  running: () => boolean;
  since: number;
}

/** How often the pool looks whether a terminated Worker has finished its work. */
const ORPHAN_POLL_MS = 20;

/** Starts a pool; its Workers start with the first work that needs one. */
export function createWorkerPool<S, R>(options: WorkerPoolOptions<S>): WorkerPool<S, R> {
  if (!(options.workers >= 1)) throw new RangeError(`At least one ${options.name} Worker (got ${options.workers})`);
  return new Pool<S, R>(options);
}

/** The pool {@linkcode createWorkerPool} starts; see the module. */
class Pool<S, R> implements WorkerPool<S, R> {
  readonly #options: WorkerPoolOptions<S>;
  readonly #slots: Slot<S, R>[] = [];
  readonly #queue = createTenantQueues<Job<S, R>>();
  /** Channels stopped whose resources are not yet released (`Channel.closed`): `close` waits for them. */
  readonly #closing = new Set<Promise<void>>();
  readonly #orphans: ReturnType<typeof createOrphans>;
  readonly #pending: ReturnType<typeof createPendingCount>;
  /** Workers kept started: `keep`, at most `workers`. */
  readonly #keep: number;
  readonly #idle: ReturnType<typeof createIdleTimer>;
  /** When a Worker failed to start or ended on its own, kept ones are not started for a while: never in a loop. */
  readonly #keepHold: ReturnType<typeof createHoldOff>;
  #nextId = 0;
  #closed = false;

  constructor(options: WorkerPoolOptions<S>) {
    this.#options = options;
    this.#orphans = createOrphans(options.orphanMs, () => this.#pump());
    this.#pending = createPendingCount(options);
    this.#keep = Math.min(options.keep ?? 0, options.workers);
    // Stops the Workers past the kept ones once nothing has run for `idleMs`.
    const slots = this.#slots;
    this.#idle = createIdleTimer(
      options.idleMs,
      () => !this.#closed && this.#pending.total === 0 && slots.length > this.#keep,
      () => {
        for (const slot of [...slots]) if (slots.length > this.#keep && slot.ready && !slot.job) this.#remove(slot);
      },
    );
    this.#keepHold = createHoldOff(options.keepRetryMs ?? KEEP_RETRY_MS, () => this.#pump());
    this.#pump();
  }

  run<T>(tenant: string, work: PoolWork<S, R, T>, signal?: AbortSignal): Promise<T> {
    if (this.#closed) return Promise.reject(new Error(`The ${this.#options.name} pool is closed`));
    if (signal?.aborted) return Promise.reject(signal.reason);
    let done: () => void;
    try {
      done = this.#pending.admit(tenant);
    } catch (error) {
      return Promise.reject(error);
    }
    return new Promise<T>((resolve, reject) => {
      // Uncounted as it settles, whichever way.
      const then = <A>(settle: (a: A) => void) => (a: A) => {
        signal?.removeEventListener("abort", giveUp);
        done();
        settle(a);
      };
      const job: Job<S, R> = {
        id: this.#nextId++,
        work,
        resolve: then(resolve as (value: unknown) => void),
        reject: then(reject),
      };
      // Still waiting for a Worker: it never begins.
      const giveUp = () => this.#queue.remove(tenant, job) && job.reject(signal!.reason);
      signal?.addEventListener("abort", giveUp, { once: true });
      this.#queue.push(tenant, job);
      this.#pump();
    });
  }

  stats(): { workers: number; orphans: number; pending: number } {
    return { workers: this.#slots.length, orphans: this.#orphans.count(), pending: this.#pending.total };
  }

  async close(): Promise<void> {
    if (this.#closed) return await Promise.all(this.#closing).then(() => {});
    this.#closed = true;
    this.#idle.stop();
    this.#keepHold.stop();
    const error = new Error(`The ${this.#options.name} pool is closed`);
    for (const slot of [...this.#slots]) {
      const job = this.#release(slot);
      this.#remove(slot);
      job?.reject(error);
    }
    this.#failWaiting(error);
    this.#orphans.clear();
    await Promise.all(this.#closing);
  }

  #release(slot: Slot<S, R>): Job<S, R> | undefined {
    const job = slot.job;
    clearTimeout(slot.timer);
    slot.timer = undefined;
    slot.job = undefined;
    return job;
  }

  #remove(slot: Slot<S, R>) {
    const working = this.#release(slot) !== undefined;
    const at = this.#slots.indexOf(slot);
    if (at >= 0) this.#slots.splice(at, 1);
    // A Worker terminated in the middle of its work finishes it first (Deno 2.9.6 interrupts no busy thread), and
    // a killed process takes a moment to be reaped: either keeps its place in the pool until it is done, or the
    // pool could grow without bound.
    const running = slot.channel.stop(working);
    if (running) this.#orphans.add(running);
    const closed = slot.channel.closed.finally(() => this.#closing.delete(closed));
    this.#closing.add(closed);
  }

  #settle(slot: Slot<S, R>, outcome: Settled<unknown>) {
    const job = this.#release(slot)!;
    // Idle now (it set itself so before its last reply): stopping it leaves no thread behind.
    if (slot.retiring) this.#remove(slot);
    if ("value" in outcome) job.resolve(outcome.value);
    else job.reject(outcome.error);
    this.#pump();
  }

  #failWaiting(error: Error) {
    for (const job of this.#queue.takeAll()) job.reject(error);
  }

  /** Fails the work waiting with `error` when no Worker is ready: it would wait for ever (no permission, say). */
  #failWaitingIfNoneReady(error: Error) {
    if (!this.#slots.some((other) => other.ready)) this.#failWaiting(error);
  }

  /** Starts a Worker: whether it could be. */
  #start(): boolean {
    let slot: Slot<S, R>;
    try {
      slot = openSlot<S, R>(this.#options, this.#events(() => slot));
    } catch (error) {
      this.#keepHold.hold();
      // Not started at all (no permission to run the child, say).
      this.#failWaitingIfNoneReady(brokenError(this.#options, error instanceof Error ? error.message : String(error)));
      return false;
    }
    slot.timer = setTimeout(() => {
      this.#keepHold.hold();
      this.#remove(slot);
      this.#failWaitingIfNoneReady(brokenError(this.#options, undefined));
      this.#pump();
    }, this.#options.startMs);
    this.#slots.push(slot);
    return true;
  }

  /** What a slot's Worker or process tells the pool. */
  #events(of: () => Slot<S, R>): SlotEvents<S, R> {
    return {
      ready: () => {
        const slot = of();
        clearTimeout(slot.timer);
        slot.timer = undefined;
        slot.ready = true;
        this.#pump();
      },
      reply: (data) => this.#reply(of(), data),
      failed: (message) => this.#failed(of(), message),
      ranOver: (job, ms) => {
        this.#remove(of());
        job.reject(job.work.timedOut(ms));
        this.#pump();
      },
    };
  }

  #reply(slot: Slot<S, R>, data: R & { id: number }) {
    const job = slot.job;
    if (!job || data.id !== job.id) return;
    let outcome: Settled<unknown> | undefined;
    try {
      outcome = job.work.reply(data, slot.handle);
    } catch (error) {
      outcome = { error };
    }
    if (outcome) this.#settle(slot, outcome);
  }

  /** The Worker failed on its own: it crashed, or something outside the pool ended it. */
  #failed(slot: Slot<S, R>, message: string) {
    const loaded = slot.ready;
    // Kept Workers wait before they start again, however this one ended: one that something kills as soon as
    // it is up (an outside killer, a host short of memory) would otherwise be started again in a loop. Work
    // that needs a Worker still starts one.
    this.#keepHold.hold();
    const job = this.#release(slot);
    const failed = brokenError(this.#options, message);
    this.#remove(slot);
    if (job) job.reject(failed);
    // One that never loaded (a missing read permission, say) fails those waiting instead of retrying for ever.
    else if (!loaded) this.#failWaitingIfNoneReady(failed);
    this.#pump();
  }

  #dispatch(slot: Slot<S, R>, job: Job<S, R>) {
    slot.job = job;
    try {
      job.work.begin(slot.handle, job.id);
    } catch (error) {
      // Nothing reached the Worker (an instance that cannot be cloned).
      this.#release(slot);
      job.reject(error);
    }
  }

  #pump() {
    if (this.#closed) return;
    const slots = this.#slots;
    while (this.#queue.size > 0) {
      const free = slots.find((slot) => slot.ready && !slot.job);
      if (!free) break;
      this.#dispatch(free, this.#queue.next()!);
    }
    const starting = slots.filter((slot) => !slot.ready).length;
    if (this.#queue.size > starting && slots.length + this.#orphans.count() < this.#options.workers) this.#start();
    // The kept ones: not while held off (a missing module would fail every start), until a timer says so.
    while (slots.length + this.#orphans.count() < this.#keep && this.#keepHold.over() && this.#start());
    this.#idle.touch();
  }
}

/** The error of a Worker that failed (its `message`) or did not load in `startMs` (no message). */
function brokenError({ title, startMs }: WorkerPoolOptions<unknown>, message: string | undefined): Error {
  return new Error(
    `The ${title} Worker ${message === undefined ? `did not start within ${startMs} ms` : `failed: ${message}`}`,
  );
}

/** What a pool does when a Worker is ready, answers, fails, or its work runs over its deadline. */
interface SlotEvents<S, R> {
  ready(): void;
  reply(data: R & { id: number }): void;
  failed(message: string): void;
  ranOver(job: Job<S, R>, ms: number): void;
}

/** Starts a Worker or child process (`pool_channels.ts`), and sends it its settings. */
function openSlot<S, R>(options: WorkerPoolOptions<S>, on: SlotEvents<S, R>): Slot<S, R> {
  const channel = openChannel({
    isolation: options.isolation ?? DEFAULT_ISOLATION,
    url: options.url,
    name: options.name,
    heapMiB: options.heapMiB ?? DEFAULT_HEAP_MIB,
    init: options.init ?? {},
  }, {
    message(data) {
      if ((data as PoolReply).type === "ready") on.ready();
      else on.reply(data as R & { id: number });
    },
    failed: (message) => on.failed(message),
  });
  const slot: Slot<S, R> = {
    channel,
    ready: false,
    retiring: false,
    handle: {
      data: options.slotData(),
      post: (message) => channel.post(message),
      retire: () => void (slot.retiring = true),
      arm(ms) {
        const job = slot.job!;
        clearTimeout(slot.timer);
        slot.timer = setTimeout(() => on.ranOver(job, ms), ms);
      },
    },
  };
  return slot;
}

/** Calls `retire` once `isIdle` has held for `idleMs` since the last `touch` (never without `idleMs`). */
function createIdleTimer(idleMs: number | undefined, isIdle: () => boolean, retire: () => void) {
  let timer: ReturnType<typeof setTimeout> | undefined;
  const stop = () => {
    clearTimeout(timer);
    timer = undefined;
  };
  return {
    touch() {
      stop();
      if (idleMs === undefined || !isIdle()) return;
      timer = setTimeout(() => {
        timer = undefined;
        if (isIdle()) retire();
      }, idleMs);
      // The timer keeps no process alive (a live Worker does, which is why it retires).
      Deno.unrefTimer(timer);
    },
    stop,
  };
}

/**
 * A hold-off: `hold` starts one of `holdMs`; `over` says whether it is over, and when it is not, arms a timer that
 * calls `resume` once it is, so that what waits for it does not wait for something else to happen.
 */
function createHoldOff(holdMs: number, resume: () => void) {
  let until = -Infinity;
  let timer: ReturnType<typeof setTimeout> | undefined;
  return {
    hold() {
      until = performance.now() + holdMs;
    },
    over(): boolean {
      const left = until - performance.now();
      if (left <= 0) return true;
      if (timer === undefined) {
        timer = setTimeout(() => {
          timer = undefined;
          resume();
        }, left);
        // Like the idle timer, it keeps no process alive.
        Deno.unrefTimer(timer);
      }
      return false;
    },
    stop() {
      clearTimeout(timer);
      timer = undefined;
    },
  };
}

/**
 * Terminated Workers still finishing their work, each counted until its state says it is no longer busy (or for
 * `orphanMs` at most); `freed` is told when one is forgotten, so that waiting work may take its place.
 */
function createOrphans(orphanMs: number, freed: () => void) {
  const orphans: Orphan[] = [];
  let timer: ReturnType<typeof setInterval> | undefined;
  /** Forgets the orphans that have finished, or have counted for `orphanMs`: whether there were any. */
  const prune = (): boolean => {
    const before = orphans.length;
    const now = performance.now();
    for (let i = orphans.length - 1; i >= 0; i--) {
      const orphan = orphans[i]!;
      if (!orphan.running() || now - orphan.since > orphanMs) orphans.splice(i, 1);
    }
    if (orphans.length === 0) clear();
    return orphans.length < before;
  };
  const clear = () => {
    orphans.length = 0;
    clearInterval(timer);
    timer = undefined;
  };
  return {
    add(running: () => boolean) {
      orphans.push({ running, since: performance.now() });
      timer ??= setInterval(() => prune() && freed(), ORPHAN_POLL_MS);
    },
    count(): number {
      // Whoever finds one gone tells the pool, as the timer would have: a kept Worker may take its place.
      if (orphans.length > 0 && prune()) queueMicrotask(freed);
      return orphans.length;
    },
    clear,
  };
}

/** Work waiting or running, by tenant and in all, admitted under the pool's caps. */
function createPendingCount(
  { maxPendingPerTenant, maxPending, busy }: Pick<
    WorkerPoolOptions<unknown>,
    "maxPendingPerTenant" | "maxPending" | "busy"
  >,
) {
  const byTenant = new Map<string, number>();
  let total = 0;
  return {
    get total() {
      return total;
    },
    /** Counts one more of `tenant`'s: @returns what uncounts it (once). @throws `busy` past a cap. */
    admit(tenant: string): () => void {
      const ofTenant = byTenant.get(tenant) ?? 0;
      if (ofTenant >= maxPendingPerTenant) throw busy(`${ofTenant} of this tenant's; at most ${maxPendingPerTenant}`);
      if (total >= maxPending) throw busy(`${total} in all; at most ${maxPending}`);
      byTenant.set(tenant, ofTenant + 1);
      total++;
      let counted = true;
      return () => {
        if (!counted) return;
        counted = false;
        total--;
        const left = byTenant.get(tenant)! - 1;
        if (left === 0) byTenant.delete(tenant);
        else byTenant.set(tenant, left);
      };
    },
  };
}

/** Work waiting for a Worker, a queue per tenant, taken from the tenants in turn. */
function createTenantQueues<J>() {
  // In turn order: a tenant served goes to the back; one whose queue empties leaves.
  const byTenant = new Map<string, J[]>();
  let size = 0;
  return {
    /** Work waiting, across tenants. */
    get size() {
      return size;
    },
    push(tenant: string, job: J) {
      const jobs = byTenant.get(tenant);
      if (jobs) jobs.push(job);
      else byTenant.set(tenant, [job]);
      size++;
    },
    /** The first waiting work of the tenant whose turn it is. */
    next(): J | undefined {
      const first = byTenant.entries().next();
      if (first.done) return undefined;
      const [tenant, jobs] = first.value;
      const job = jobs.shift()!;
      byTenant.delete(tenant);
      if (jobs.length > 0) byTenant.set(tenant, jobs);
      size--;
      return job;
    },
    /** Takes `job` out of `tenant`'s queue: whether it was waiting there. */
    remove(tenant: string, job: J): boolean {
      const jobs = byTenant.get(tenant);
      const at = jobs?.indexOf(job) ?? -1;
      if (at < 0) return false;
      jobs!.splice(at, 1);
      if (jobs!.length === 0) byTenant.delete(tenant);
      size--;
      return true;
    },
    takeAll(): J[] {
      const all = [...byTenant.values()].flat();
      byTenant.clear();
      size = 0;
      return all;
    },
  };
}
