/**
 * Validation of instances against tenants' schemas with a bound on the work
 * one validation can take. Regular expressions run on RE2 (`linear_regex.ts`),
 * but a validation can still be costly: a long string against a large
 * expression, `uniqueItems` (every item against every other), or in-place
 * fan-out through `$ref` (`anyOf` of two branches that recurse into a
 * property: 2^depth).
 *
 * So a validation runs in the caller's thread only when it is known to be
 * small: no keyword whose cost the estimate cannot bound, and an estimate
 * (`validation_cost.ts`: the schema walked over the instance as the validator
 * does, stopped at the budget) under `fastPathUnits`. Anything else runs on a
 * small pool of Web Workers (`validation_worker.ts`): the Worker estimates it
 * again, refuses it past `workerUnits` ({@linkcode ValidationTooCostly}), and
 * runs it under a deadline. A Worker that runs over is terminated, that
 * validation fails with {@linkcode ValidationTimeout}, and a fresh Worker takes
 * the next one. Both sides cache compiled schemas per key.
 *
 * In Deno 2.9.6 a terminated Worker that is busy goes on until its validation
 * ends (`terminate()` interrupts neither a regular expression nor a loop), so
 * the pool counts it until it has (the Worker says so in shared memory), and
 * `workerUnits` is what bounds how long that is. Validations waiting for or
 * running on a Worker are capped per tenant and in all: past either cap a
 * validation fails at once with {@linkcode ValidationBusy}.
 */
import { compileSchema, type SchemaViolation } from "./json_schema.ts";
import { Lru } from "./_lru.ts";
import { costed, type CostedSchema, estimate } from "./validation_cost.ts";
import { type InitMessage, type ValidateMessage, WORKER_STATE, type WorkerReply } from "./_validation_protocol.ts";
import { type Clock, systemClock } from "../retry/clock.ts";
import type { Deadline } from "../retry/deadline.ts";
import { DeadlineExceeded } from "../retry/errors.ts";

/** Defaults of {@linkcode createSchemaValidators}. */
export const VALIDATION_LIMITS: Readonly<Required<ValidatorOptions>> = {
  /** Wall-clock time one validation may take on a validation Worker, from when that Worker starts it. */
  deadlineMs: 250,
  /** Compiled schemas kept, in the caller's thread and in each Worker. */
  cacheSize: 500,
  /**
   * What they may hold, in bytes (`CompiledSchema.weight`: about eight times a schema's JSON, and each regular
   * expression's program and DFA), in the caller's thread and in each Worker.
   */
  cacheBytes: 64 * 1024 * 1024,
  /**
   * Work a validation may be estimated at and still run in the caller's thread: one unit is a subschema
   * evaluated on one value, one keyword or array entry or key of either, or 64 characters of a string, and a
   * regular expression costs per character by its size (`validation_cost.ts`). Measured, a unit took at most
   * 0.55 µs of `@cfworker/json-schema` (2 µs for a string of "t"s against `format: date-time`, which splits it
   * at each one): so at most about 1 ms here, 4 ms in the worst case.
   */
  fastPathUnits: 2_000,
  /**
   * Work a validation may be estimated at and run at all, on a Worker (about 0.5 s, 2 s in the worst case):
   * past it, it fails with {@linkcode ValidationTooCostly} without running. A Worker that is terminated at the
   * deadline runs on until its validation ends, so this, not the deadline, bounds how long that is.
   */
  workerUnits: 1_000_000,
  /** Validations of one tenant waiting for or running on a Worker; past it, {@linkcode ValidationBusy}. */
  maxPendingPerTenant: 8,
  /** Validations waiting for or running on a Worker, all tenants together; past it, {@linkcode ValidationBusy}. */
  maxPending: 64,
  /** Time a Worker may take to compile a schema it has not seen (bounded by `compileSchema`'s limits). */
  compileMs: 1_000,
  /** Web Workers validating at once. */
  workers: 2,
  /** How long a Worker may take to load before the validations waiting for it fail. */
  startMs: 10_000,
  /**
   * How long a terminated Worker counts against the pool at most, should it never say it has finished (were it
   * ever stopped mid-validation, it could not): far longer than `workerUnits` of work takes.
   */
  orphanMs: 30_000,
};

/** Raised when a validation would take longer than the deadline. */
export class ValidationTimeout extends Error {
  constructor(readonly deadlineMs: number, options?: ErrorOptions) {
    super(`Schema validation took longer than ${deadlineMs} ms`, options);
    this.name = "ValidationTimeout";
  }
}

/**
 * Raised when a validation is estimated at more work than a Worker may do (`workerUnits`): it did not run, and
 * would not run on another try either.
 */
export class ValidationTooCostly extends Error {
  constructor(readonly maxUnits: number, options?: ErrorOptions) {
    super(
      `Schema validation of this value would take too long (estimated at more than ${maxUnits} units of work)`,
      options,
    );
    this.name = "ValidationTooCostly";
  }
}

/**
 * Raised when a validation needs a Worker and too many are pending already, the tenant's or everyone's (the
 * caps of {@linkcode VALIDATION_LIMITS}): it did not run; another try may, after `retryAfterS`.
 */
export class ValidationBusy extends Error {
  readonly retryAfterS = 1;
  constructor(what: string, options?: ErrorOptions) {
    super(`Too many schema validations are waiting for a Worker (${what})`, options);
    this.name = "ValidationBusy";
  }
}

/** How {@linkcode validateWithin} asks again after a timeout. */
export const VALIDATION_RETRY = {
  /** The most a first wait before asking again may be (full jitter); it doubles with each try... */
  baseMs: 50,
  /** ...up to this. */
  capMs: 1_000,
} as const;

/**
 * Validates, and asks again after a {@linkcode ValidationTimeout} or a {@linkcode ValidationBusy} while
 * `deadline` leaves room for the wait and one more try. Neither is a verdict on the instance: a Worker starved
 * of CPU (a busy host, the pool's other Workers) runs over just as a costly instance does, and a full pool is
 * the pool's. So neither is ever reported as a violation. Each try keeps the validator's own deadline, so a
 * stalling instance holds a Worker no longer per try than before.
 * @returns the violations, as `validate` returns them.
 * @throws {DeadlineExceeded} when the tries kept failing so until `deadline` left no room (the last failure
 * as its cause).
 * @throws whatever else `validate` throws (a {@linkcode ValidationTooCostly} too), at once.
 */
export async function validateWithin(
  validate: (key: string, schema: unknown, instance: unknown) => Promise<SchemaViolation[]>,
  { key, schema, instance }: { key: string; schema: unknown; instance: unknown },
  { deadline, signal, clock = systemClock, random = Math.random }: {
    deadline: Deadline;
    signal?: AbortSignal;
    clock?: Clock;
    random?: () => number;
  },
): Promise<SchemaViolation[]> {
  for (let tries = 1;; tries++) {
    try {
      return await validate(key, schema, instance);
    } catch (error) {
      if (!(error instanceof ValidationTimeout || error instanceof ValidationBusy)) throw error;
      const waitMs = Math.round(
        random() * Math.min(VALIDATION_RETRY.capMs, VALIDATION_RETRY.baseMs * 2 ** (tries - 1)),
      );
      const tryMs = error instanceof ValidationTimeout ? error.deadlineMs : VALIDATION_LIMITS.deadlineMs;
      if (deadline.remaining() < waitMs + tryMs) {
        const what = error instanceof ValidationTimeout ? "timed out" : "found the validators busy";
        throw new DeadlineExceeded(`schema validation of ${key} ${what} ${tries} times within the deadline`, {
          cause: error,
        });
      }
      await clock.sleep(waitMs, signal);
    }
  }
}

/** Validators of tenants' schemas, with their compiled schemas cached per key. */
export interface SchemaValidators {
  /**
   * Validates `instance` against `schema`, compiled once per `key` (e.g. "tenant/task/version/input"): a key
   * names one schema for good, and a later call with the same key uses the schema compiled first.
   * `tenant`: whose turn a validation waiting for a Worker takes (default: the key's first segment; a built-in
   * task's key, shared by every tenant, starts with "/").
   * @returns the violations, the first (deepest) first, as `CompiledSchema.validate` returns them; [] when valid.
   * @throws {ValidationTimeout} when it would take longer than the deadline.
   * @throws {ValidationTooCostly} when it is estimated at more than `workerUnits`.
   * @throws {ValidationBusy} when it needs a Worker and the tenant, or everyone, has too many pending.
   * @throws {SchemaRefused} when `compileSchema` refuses `schema` (as a stored schema: `{ stored: true }`).
   */
  validate(key: string, schema: unknown, instance: unknown, tenant?: string): Promise<SchemaViolation[]>;
  /**
   * The fast path alone, without a wait: the violations when the validation is small enough for this
   * thread, undefined when it must go to a Worker (call `validate`).
   * @throws {SchemaRefused} when `compileSchema` refuses `schema`.
   */
  validateNow(key: string, schema: unknown, instance: unknown, units?: number): SchemaViolation[] | undefined;
  /**
   * What the pool holds now: its Workers, the terminated ones still finishing a validation (which count against
   * `workers` until they have), and the validations waiting for or running on a Worker.
   */
  pool(): { workers: number; orphans: number; pending: number };
  /** Terminates the Workers; validations still waiting or running reject. */
  close(): Promise<void>;
}

/** Options of {@linkcode createSchemaValidators}; each defaults to its {@linkcode VALIDATION_LIMITS} entry. */
export interface ValidatorOptions {
  deadlineMs?: number;
  cacheSize?: number;
  cacheBytes?: number;
  /** 0 sends every validation to a Worker. */
  fastPathUnits?: number;
  compileMs?: number;
  workers?: number;
  startMs?: number;
  workerUnits?: number;
  maxPendingPerTenant?: number;
  maxPending?: number;
  orphanMs?: number;
}

interface Job {
  id: number;
  key: string;
  schema: unknown;
  instance: unknown;
  resolve(violations: SchemaViolation[]): void;
  reject(error: unknown): void;
}

/**
 * A Worker, the job it is running, the keys it has been sent (mirroring its own cache), and its state in shared
 * memory (`WORKER_STATE` in `_validation_protocol.ts`).
 */
interface Slot {
  worker: Worker;
  ready: boolean;
  job?: Job;
  timer?: ReturnType<typeof setTimeout>;
  sent: Lru<string, true>;
  state: Int32Array;
}

/** A terminated Worker that was validating: it counts against the pool until it is no longer busy. */
interface Orphan {
  state: Int32Array;
  since: number;
}

const WORKER_URL = new URL("./validation_worker.ts", import.meta.url).href;

/** How often the pool looks whether a terminated Worker has finished its validation. */
const ORPHAN_POLL_MS = 20;

/**
 * Starts validators. Workers start on the first validation that needs one.
 *
 * A validation waits in its tenant's queue until a Worker is free (the tenant asking; by default the key's first
 * segment), and free Workers take from the tenants' queues in turn: a validation waits for those running and at
 * most one of each other waiting tenant's per turn, not for another tenant's whole burst. The deadline counts from when a
 * validation reaches a Worker, so a slow one delays those behind it by at most the deadline. A Worker runs one
 * validation at a time, so a timeout terminates only the validation that ran over; the queue goes on with a
 * fresh Worker once the pool has room: a terminated Worker still validating takes a place in it until it ends.
 */
export function createSchemaValidators(options: ValidatorOptions = {}): SchemaValidators {
  const limits = { ...VALIDATION_LIMITS };
  for (const [name, value] of Object.entries(options) as [keyof ValidatorOptions, number | undefined][]) {
    if (value !== undefined) limits[name] = value;
  }
  if (!(limits.workers >= 1)) throw new RangeError(`At least one validation Worker (got ${limits.workers})`);
  const cache = new Lru<string, CostedSchema>(limits.cacheSize, {
    maxWeight: limits.cacheBytes,
    weigh: (entry) => entry.compiled.weight,
  });
  const slots: Slot[] = [];
  const orphans: Orphan[] = [];
  let orphanTimer: ReturnType<typeof setInterval> | undefined;
  const queue = createTenantQueues();
  /** Validations waiting for or running on a Worker, by tenant, and in all. */
  const pending = new Map<string, number>();
  let pendingTotal = 0;
  let nextId = 0;
  let closed = false;

  const compiledFor = (key: string, schema: unknown): CostedSchema => {
    let entry = cache.get(key);
    if (!entry) {
      // A copy of our own: the validator keeps (and annotates) the schema it compiles. Stored: it was checked
      // when it was PUT, perhaps by an earlier release's rules.
      const copy = structuredClone(schema);
      entry = costed(copy, compileSchema(copy, { stored: true }));
      cache.set(key, entry);
    }
    return entry;
  };

  const release = (slot: Slot) => {
    clearTimeout(slot.timer);
    slot.timer = undefined;
    slot.job = undefined;
  };

  const remove = (slot: Slot) => {
    release(slot);
    slot.worker.terminate();
    slots.splice(slots.indexOf(slot), 1);
    // A Worker terminated in the middle of a validation finishes it first (Deno 2.9.6 interrupts no busy
    // thread): it keeps its place in the pool until it has, or the pool could grow without bound. One that has
    // not begun is told not to: then it never will.
    if (Atomics.compareExchange(slot.state, 0, WORKER_STATE.idle, WORKER_STATE.cancelled) === WORKER_STATE.busy) {
      orphans.push({ state: slot.state, since: performance.now() });
      orphanTimer ??= setInterval(() => pruneOrphans() && pump(), ORPHAN_POLL_MS);
    }
  };

  /** Forgets the orphans that have finished (or that have counted for `orphanMs`): whether there were any. */
  const pruneOrphans = (): boolean => {
    const before = orphans.length;
    const now = performance.now();
    for (let i = orphans.length - 1; i >= 0; i--) {
      const orphan = orphans[i]!;
      if (Atomics.load(orphan.state, 0) !== WORKER_STATE.busy || now - orphan.since > limits.orphanMs) {
        orphans.splice(i, 1);
      }
    }
    if (orphans.length === 0) {
      clearInterval(orphanTimer);
      orphanTimer = undefined;
    }
    return orphans.length < before;
  };

  /**
   * Sends `job` to `slot`'s Worker, with the schema when asked, and arms the timer: `compileMs` for a
   * schema to compile (the Worker says `compiled` when it starts validating), else the deadline.
   */
  const post = (slot: Slot, job: Job, withSchema: boolean) => {
    const message: ValidateMessage = { type: "validate", id: job.id, key: job.key, instance: job.instance };
    if (withSchema) message.schema = job.schema;
    slot.worker.postMessage(message);
    arm(slot, job, withSchema ? limits.compileMs : limits.deadlineMs);
  };

  const arm = (slot: Slot, job: Job, ms: number) => {
    clearTimeout(slot.timer);
    slot.timer = setTimeout(() => {
      remove(slot);
      job.reject(new ValidationTimeout(ms));
      pump();
    }, ms);
  };

  const dispatch = (slot: Slot, job: Job) => {
    slot.job = job;
    try {
      post(slot, job, slot.sent.get(job.key) === undefined);
    } catch (error) {
      // The instance cannot be cloned (a function, a symbol): nothing reached the Worker.
      release(slot);
      job.reject(error);
      return;
    }
    slot.sent.set(job.key, true);
  };

  const failWaiting = (error: Error) => {
    for (const job of queue.takeAll()) job.reject(error);
  };

  const start = () => {
    const worker = new Worker(WORKER_URL, { type: "module", name: "schema-validation" });
    const state = new Int32Array(new SharedArrayBuffer(4));
    const slot: Slot = { worker, ready: false, sent: new Lru(limits.cacheSize), state };
    slot.timer = setTimeout(() => {
      remove(slot);
      if (!slots.some((other) => other.ready)) {
        failWaiting(new Error(`The schema validation Worker did not start within ${limits.startMs} ms`));
      }
      pump();
    }, limits.startMs);
    worker.onmessage = ({ data }: MessageEvent<WorkerReply>) => {
      if (data.type === "ready") {
        clearTimeout(slot.timer);
        slot.timer = undefined;
        slot.ready = true;
        return pump();
      }
      const job = slot.job;
      if (!job || data.id !== job.id) return;
      if (data.type === "missing") return post(slot, job, true);
      if (data.type === "compiled") return arm(slot, job, limits.deadlineMs);
      release(slot);
      if (data.type === "result") job.resolve(data.violations);
      else if (data.type === "costly") job.reject(new ValidationTooCostly(limits.workerUnits));
      else job.reject(rebuildError(data.name, data.message));
      pump();
    };
    worker.onerror = (event) => {
      // Unhandled, a Worker's error would end this process.
      event.preventDefault();
      const job = slot.job;
      const failed = new Error(`The schema validation Worker failed: ${event.message}`);
      remove(slot);
      if (job) job.reject(failed);
      // One that never loaded (a missing read permission, say) fails those waiting instead of retrying for ever.
      else if (!slot.ready && !slots.some((other) => other.ready)) failWaiting(failed);
      pump();
    };
    worker.postMessage(
      {
        type: "init",
        cacheSize: limits.cacheSize,
        cacheBytes: limits.cacheBytes,
        workerUnits: limits.workerUnits,
        state: state.buffer,
      } satisfies InitMessage,
    );
    slots.push(slot);
  };

  const pump = () => {
    if (closed) return;
    while (queue.size > 0) {
      const idle = slots.find((slot) => slot.ready && !slot.job);
      if (!idle) break;
      dispatch(idle, queue.next()!);
    }
    if (orphans.length > 0) pruneOrphans();
    const starting = slots.filter((slot) => !slot.ready).length;
    if (queue.size > starting && slots.length + orphans.length < limits.workers) start();
  };

  /** Counts a validation as pending until it settles, or refuses it past a cap. */
  const admit = (tenant: string, job: Omit<Job, "id">): Job => {
    const ofTenant = pending.get(tenant) ?? 0;
    if (ofTenant >= limits.maxPendingPerTenant) {
      throw new ValidationBusy(`${ofTenant} of this tenant's; at most ${limits.maxPendingPerTenant}`);
    }
    if (pendingTotal >= limits.maxPending) {
      throw new ValidationBusy(`${pendingTotal} in all; at most ${limits.maxPending}`);
    }
    pending.set(tenant, ofTenant + 1);
    pendingTotal++;
    let settled = false;
    const settle = () => {
      if (settled) return;
      settled = true;
      pendingTotal--;
      const left = pending.get(tenant)! - 1;
      if (left === 0) pending.delete(tenant);
      else pending.set(tenant, left);
    };
    return {
      ...job,
      id: nextId++,
      resolve(violations) {
        settle();
        job.resolve(violations);
      },
      reject(error) {
        settle();
        job.reject(error);
      },
    };
  };

  return {
    validateNow(key, schema, instance, units) {
      if (closed) throw new Error("The schema validators are closed");
      const entry = compiledFor(key, schema);
      if (!entry.linear) return undefined;
      // Without references or regular expressions, no subschema applies twice to one part of the value: the
      // schema's weight times the value's size bounds the work, with no need to walk the two together.
      const bounded = entry.tree && units !== undefined && entry.total * units <= limits.fastPathUnits;
      return bounded || estimate(entry, instance, limits.fastPathUnits) <= limits.fastPathUnits
        ? entry.compiled.validate(instance)
        : undefined;
    },
    validate(key, schema, instance, tenant = tenantOf(key)) {
      if (closed) return Promise.reject(new Error("The schema validators are closed"));
      let entry: CostedSchema;
      try {
        entry = compiledFor(key, schema);
        if (entry.linear && estimate(entry, instance, limits.fastPathUnits) <= limits.fastPathUnits) {
          return Promise.resolve(entry.compiled.validate(instance));
        }
      } catch (error) {
        return Promise.reject(error);
      }
      return new Promise((resolve, reject) => {
        queue.push(tenant, admit(tenant, { key, schema: entry.schema, instance, resolve, reject }));
        pump();
      });
    },
    pool() {
      if (orphans.length > 0) pruneOrphans();
      return { workers: slots.length, orphans: orphans.length, pending: pendingTotal };
    },
    close() {
      if (closed) return Promise.resolve();
      closed = true;
      const error = new Error("The schema validators are closed");
      for (const slot of [...slots]) {
        const job = slot.job;
        remove(slot);
        job?.reject(error);
      }
      failWaiting(error);
      orphans.length = 0;
      clearInterval(orphanTimer);
      orphanTimer = undefined;
      cache.clear();
      return Promise.resolve();
    },
  };
}

/** The tenant a validation key names: its first segment ("tenant/task/version/input"; "" for built-in tasks). */
function tenantOf(key: string): string {
  const slash = key.indexOf("/");
  return slash < 0 ? key : key.slice(0, slash);
}

/** Validations waiting for a Worker, a queue per tenant, taken from the tenants in turn. */
function createTenantQueues() {
  // In turn order: a tenant served goes to the back; one whose queue empties leaves.
  const byTenant = new Map<string, Job[]>();
  let size = 0;
  return {
    /** Validations waiting, across tenants. */
    get size() {
      return size;
    },
    push(tenant: string, job: Job) {
      const jobs = byTenant.get(tenant);
      if (jobs) jobs.push(job);
      else byTenant.set(tenant, [job]);
      size++;
    },
    /** The first waiting validation of the tenant whose turn it is. */
    next(): Job | undefined {
      const first = byTenant.entries().next();
      if (first.done) return undefined;
      const [tenant, jobs] = first.value;
      const job = jobs.shift()!;
      byTenant.delete(tenant);
      if (jobs.length > 0) byTenant.set(tenant, jobs);
      size--;
      return job;
    },
    takeAll(): Job[] {
      const all = [...byTenant.values()].flat();
      byTenant.clear();
      size = 0;
      return all;
    },
  };
}

/** An error the Worker reported, as the class it had when it is a built-in one. */
function rebuildError(name: string, message: string): Error {
  const error = name === "RangeError"
    ? new RangeError(message)
    : name === "TypeError"
    ? new TypeError(message)
    : new Error(message);
  if (error.name !== name) error.name = name;
  return error;
}
