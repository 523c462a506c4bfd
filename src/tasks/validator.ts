/**
 * Validation of instances against tenants' schemas with a bound on the work
 * one validation can take. Regular expressions run on RE2 (`linear_regex.ts`),
 * but a validation can still be costly: a long string against a large
 * expression, `uniqueItems` (every item against every other), or in-place
 * fan-out through `$ref` (`anyOf` of two branches that recurse into a
 * property: 2^depth).
 *
 * So a validation runs in the caller's thread only when it is known to be
 * small: a schema small enough to compile there (`threadSchemaBytes`), no
 * keyword whose cost the estimate cannot bound, and an estimate
 * (`validation_cost.ts`: the schema walked over the instance as the validator
 * does, stopped at the budget) under `fastPathUnits`. Anything else runs on a
 * small pool of Workers (`worker_pool.ts`, `validation_worker.ts`; child
 * processes, or Web Workers in a compiled binary: `pool_channels.ts`): the
 * Worker compiles the schema (a large one only there), estimates the
 * validation again, refuses it past `workerUnits`
 * ({@linkcode ValidationTooCostly}), and runs it under a deadline. A Worker
 * that runs over is terminated, that validation fails with
 * {@linkcode ValidationTimeout}, and a fresh Worker takes the next one. Both
 * sides cache compiled schemas per key.
 *
 * A child process that runs over is killed at once. In Deno 2.9.6 a
 * terminated Web Worker that is busy goes on until its validation
 * ends (`terminate()` interrupts neither a regular expression nor a loop), so
 * the pool counts it until it has, and `workerUnits` is what bounds how long
 * that is. Validations waiting for or running on a Worker are capped per
 * tenant and in all: past either cap a validation fails at once with
 * {@linkcode ValidationBusy}.
 */
import { compileSchema, SchemaRefused, type SchemaViolation, ValidationTooDeep } from "./json_schema.ts";
import { Lru } from "./_lru.ts";
import { costed, type CostedSchema, estimate } from "./validation_cost.ts";
import type { ValidateMessage, ValidationInit, ValidationReply } from "./_validation_protocol.ts";
import { createWorkerPool, type PoolSlot, type WorkerPool } from "./worker_pool.ts";
import type { PoolIsolation } from "./pool_channels.ts";
import { type Clock, systemClock } from "../retry/clock.ts";
import type { Deadline } from "../retry/deadline.ts";
import { DeadlineExceeded } from "../retry/errors.ts";
import { linkedSignal } from "../async/linked_signal.ts";

/** Defaults of {@linkcode createSchemaValidators}. */
export const VALIDATION_LIMITS: Readonly<Required<ValidatorOptions>> = {
  /** Wall-clock time one validation may take on a validation Worker, from when that Worker starts it. */
  deadlineMs: 250,
  /** Compiled schemas kept, in the caller's thread and in each Worker. */
  cacheSize: 500,
  /**
   * The largest schema (its JSON, in characters) compiled in the caller's thread: compiling there takes time in
   * proportion to the schema's size (measured in the README, "Every validation is bounded in time"), once per
   * key. A larger one is compiled, and its every validation run, on a Worker.
   */
  threadSchemaBytes: 2_048,
  /**
   * The most `pattern` and `patternProperties` keywords a schema compiled in the caller's thread may have, and
   * they must not be costly to compile (`costlyPatterns`): a schema with more, or costly ones, is compiled, and
   * validated, on a Worker. Not none: every validation of such a schema would then wait for a Worker, and a
   * tenant's burst of runs would meet the cap of `maxPendingPerTenant`.
   */
  threadPatterns: 4,
  /**
   * What they may hold, in bytes (`CompiledSchema.weight`: about eight times a schema's JSON, and each regular
   * expression's program and DFA, more than the heap a compiled schema was measured to take: see README, "Every
   * validation is bounded in time"), in the caller's thread and in each Worker: three caches in an API process.
   */
  cacheBytes: 16 * 1024 * 1024,
  /**
   * Work a validation may be estimated at and still run in the caller's thread: one unit is a subschema
   * evaluated on one value, one keyword or array entry or key of either, or 64 characters of a string, and a
   * regular expression costs per character by its size (`validation_cost.ts`). With what a unit was measured to
   * take, that is about a millisecond here, a few in the worst case (`format: date-time` on a string of "t"s,
   * which it splits at each one): see README, "Every validation is bounded in time".
   */
  fastPathUnits: 2_000,
  /**
   * Work a validation may be estimated at and run at all, on a Worker: past it, it fails with
   * {@linkcode ValidationTooCostly} without running. A Worker that is terminated at the deadline runs on until its
   * validation ends, so this, not the deadline, bounds how long that is. It fits the deadline, and a tenant's
   * `maxPendingPerTenant` of them fit a second on two Workers: at 1,000,000 a validation the estimate admitted
   * could not finish in 250 ms, so each one ran over, and a tenant's eight at once were answered long after it;
   * at 400,000, most of them timed out (what it takes, and those runs, are in the README, "Every validation is
   * bounded in time"). An input past it (say 15,000 small objects, or 100 KB of text against a pattern) is a
   * `422`.
   */
  workerUnits: 200_000,
  /** Validations of one tenant waiting for or running on a Worker; past it, {@linkcode ValidationBusy}. */
  maxPendingPerTenant: 8,
  /** Validations waiting for or running on a Worker, all tenants together; past it, {@linkcode ValidationBusy}. */
  maxPending: 64,
  /** Time a Worker may take to compile a schema it has not seen (bounded by `compileSchema`'s limits). */
  compileMs: 1_000,
  /**
   * Schema JSON a Worker may have been sent to compile before it is stopped (once its validation is done) and a
   * fresh one takes its place: its heap grows with what it compiles and never shrinks, and a stopped one gives it
   * all back (a child process to the system; a Web Worker's stays in the process's resident memory). 1 MiB is 16
   * of the largest schemas, hundreds of usual ones; a child's start costs little beside compiling 1 MiB, and at
   * 4 MiB the validation children held more after two tenants' quotas of the largest definitions were run once
   * (both measured in the README, "Defining a task").
   */
  recycleChars: 1024 * 1024,
  /**
   * A Worker with nothing to validate for this long is stopped too (the next validation starts one). Not less: a
   * child starts cold (CPU to start, and its code not yet optimised), and at 10 s the hostile bench's floods, 15 s
   * apart, met a fresh pair each time, their first answers slower (see README, "Every validation is bounded in time").
   */
  idleMs: 60_000,
  /** A validation child process's V8 heap cap, in MiB: past it the child ends, and only its work fails. */
  heapMiB: 128,
  /**
   * Workers kept started, however idle (the API and worker processes keep all of them): a child costs CPU and
   * memory to start, and a flood of hostile validations that had to start two held another tenant's p99 well
   * above what it was once they were up (see README, "Every validation is bounded in time"). Unset, a pool
   * starts them as it needs them.
   */
  keep: 0,
  /** Web Workers validating at once. */
  workers: 2,
  /** How long a Worker may take to load before the validations waiting for it fail. */
  startMs: 10_000,
  /**
   * How long a terminated Worker counts against the pool at most, should it never say it has finished (were it
   * ever stopped mid-validation, it could not). Far longer than `workerUnits` of work should take: were the
   * estimate ever wrong, a thread still running past this would be one more thread than the pool's (at 30 s, an
   * underestimate once ran more validation threads than the pool's two: see README, "Every validation is bounded
   * in time").
   */
  orphanMs: 600_000,
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
 * as its cause), or a try was still waiting for a Worker at the deadline.
 * @throws whatever else `validate` throws (a {@linkcode ValidationTooCostly} too), at once.
 */
export async function validateWithin(
  validate: (key: string, schema: unknown, instance: unknown, signal: AbortSignal) => Promise<SchemaViolation[]>,
  { key, schema, instance }: { key: string; schema: unknown; instance: unknown },
  { deadline, signal, clock = systemClock, random = Math.random }: {
    deadline: Deadline;
    signal?: AbortSignal;
    clock?: Clock;
    random?: () => number;
  },
): Promise<SchemaViolation[]> {
  for (let tries = 1;; tries++) {
    // A try still waiting for a Worker at the deadline gives up waiting (`signal` of `validate`): a starved pool
    // must not hold the delivery past its budget.
    const late = new AbortController();
    const timer = setTimeout(
      () => late.abort(new DeadlineExceeded(`schema validation of ${key} waited for a validator past the deadline`)),
      // (A timer's delay past 2^31 - 1 ms would fire at once.)
      Math.min(deadline.remaining(), 2 ** 31 - 1),
    );
    const linked = signal ? linkedSignal(signal, late.signal) : { signal: late.signal, unlink: () => {} };
    try {
      return await validate(key, schema, instance, linked.signal);
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
    } finally {
      clearTimeout(timer);
      linked.unlink();
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
   * @throws `signal`'s reason when it aborts while the validation waits for a Worker.
   */
  validate(
    key: string,
    schema: unknown,
    instance: unknown,
    tenant?: string,
    signal?: AbortSignal,
  ): Promise<SchemaViolation[]>;
  /**
   * The fast path alone, without a wait: the violations when the validation is small enough for this
   * thread, undefined when it must go to a Worker (call `validate`).
   * @throws {SchemaRefused} when `compileSchema` refuses `schema`.
   */
  validateNow(key: string, schema: unknown, instance: unknown, units?: number): SchemaViolation[] | undefined;
  /**
   * Compiles `schema` under `key` where its validations will run (this thread when it is small, else a
   * Worker), so that a schema this release cannot compile is found before it is needed: a run's output
   * schema before its model call, say.
   * @throws {SchemaRefused} when `compileSchema` refuses `schema`; as `validate` otherwise.
   */
  prepare(key: string, schema: unknown, tenant?: string): Promise<void>;
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
  /** 0 compiles every schema on a Worker only (and so validates there). */
  threadSchemaBytes?: number;
  threadPatterns?: number;
  recycleChars?: number;
  idleMs?: number;
  heapMiB?: number;
  keep?: number;
  compileMs?: number;
  workers?: number;
  startMs?: number;
  workerUnits?: number;
  maxPendingPerTenant?: number;
  maxPending?: number;
  orphanMs?: number;
}

/** What the validators keep of each Worker: the keys sent it (mirroring its cache), and what it has compiled. */
interface WorkerMemo {
  sent: Lru<string, true>;
  /** Characters of schema JSON sent it to compile: past `recycleChars`, it is stopped and a fresh one started. */
  compiledChars: number;
}

/** A schema too large to compile in the caller's thread: its validations all run on a Worker. */
const ON_WORKER: unique symbol = Symbol("on a Worker");
/** The same, known to compile: a Worker has. */
const COMPILES_ON_WORKER: unique symbol = Symbol("compiles on a Worker");

/** What the caller's thread keeps per key: the schema compiled, or where it is, or why it cannot be compiled. */
type Entry = CostedSchema | typeof ON_WORKER | typeof COMPILES_ON_WORKER | SchemaRefused;

const WORKER_URL = new URL("./validation_worker.ts", import.meta.url).href;

/** What a validator's calls share: its settings, its cache of compiled schemas, and its pool of Workers. */
interface Validation {
  limits: Required<ValidatorOptions>;
  cache: Lru<string, Entry>;
  pool: WorkerPool<WorkerMemo, ValidationReply>;
}

/**
 * Starts validators. Workers start on the first validation that needs one; a validation waits for a Worker in
 * its tenant's turn (`worker_pool.ts`). The deadline counts from when a validation reaches a Worker, so a slow
 * one delays those behind it by at most the deadline.
 */
export function createSchemaValidators(
  { isolation, ...options }: ValidatorOptions & { isolation?: PoolIsolation } = {},
): SchemaValidators {
  const limits = { ...VALIDATION_LIMITS };
  for (const [name, value] of Object.entries(options) as [keyof ValidatorOptions, number | undefined][]) {
    if (value !== undefined) limits[name] = value;
  }
  if (!(limits.workers >= 1)) throw new RangeError(`At least one validation Worker (got ${limits.workers})`);
  const v: Validation = {
    limits,
    // A refusal is kept too: a version whose schema this release cannot compile is asked about on every run.
    cache: new Lru<string, Entry>(limits.cacheSize, {
      maxWeight: limits.cacheBytes,
      weigh: (entry) => typeof entry === "symbol" || entry instanceof SchemaRefused ? 0 : entry.compiled.weight,
    }),
    pool: validationPool(limits, isolation),
  };
  /** Compilations of large schemas on a Worker under way (`prepare`), by key: callers at once share one. */
  const preparing = new Map<string, Promise<void>>();
  let closed = false;

  return {
    validateNow(key, schema, instance, units) {
      if (closed) throw new Error("The schema validators are closed");
      const entry = compiledFor(v, key, schema);
      if (typeof entry === "symbol" || !entry.linear) return undefined;
      // Without references or regular expressions, no subschema applies twice to one part of the value: the
      // schema's weight times the value's size bounds the work, with no need to walk the two together.
      const bounded = entry.tree && units !== undefined && entry.total * units <= limits.fastPathUnits;
      return bounded || estimate(entry, instance, limits.fastPathUnits) <= limits.fastPathUnits
        ? inThread(v, entry, instance)
        : undefined;
    },
    validate(key, schema, instance, tenant = tenantOf(key), signal) {
      if (closed) return Promise.reject(new Error("The schema validators are closed"));
      let entry: Exclude<Entry, SchemaRefused>;
      try {
        entry = compiledFor(v, key, schema);
        if (
          typeof entry !== "symbol" && entry.linear &&
          estimate(entry, instance, limits.fastPathUnits) <= limits.fastPathUnits
        ) {
          return Promise.resolve(inThread(v, entry, instance));
        }
      } catch (error) {
        return Promise.reject(error);
      }
      return onWorker(v, tenant, { key, schema: typeof entry === "symbol" ? schema : entry.schema, instance }, signal);
    },
    async prepare(key, schema, tenant = tenantOf(key)) {
      if (closed) throw new Error("The schema validators are closed");
      if (compiledFor(v, key, schema) !== ON_WORKER) return;
      let compiling = preparing.get(key);
      if (!compiling) {
        compiling = onWorker(v, tenant, { key, schema }).then(() => {}).finally(() => preparing.delete(key));
        preparing.set(key, compiling);
      }
      await compiling;
    },
    pool: () => v.pool.stats(),
    async close() {
      closed = true;
      v.cache.clear();
      await v.pool.close();
    },
  };
}

/** The validators' pool of Workers (`validation_worker.ts`), as `limits` size it. */
function validationPool(limits: Required<ValidatorOptions>, isolation: PoolIsolation | undefined) {
  return createWorkerPool<WorkerMemo, ValidationReply>({
    url: WORKER_URL,
    name: "schema-validation",
    workers: limits.workers,
    startMs: limits.startMs,
    orphanMs: limits.orphanMs,
    idleMs: limits.idleMs,
    maxPendingPerTenant: limits.maxPendingPerTenant,
    maxPending: limits.maxPending,
    init: {
      cacheSize: limits.cacheSize,
      cacheBytes: limits.cacheBytes,
      workerUnits: limits.workerUnits,
    } satisfies ValidationInit,
    // The keys sent to each Worker, mirroring its own cache: a schema crosses the channel once.
    slotData: () => ({ sent: new Lru(limits.cacheSize), compiledChars: 0 }),
    busy: (what) => new ValidationBusy(what),
    title: "schema validation",
    isolation,
    heapMiB: limits.heapMiB,
    keep: limits.keep,
  });
}

/**
 * The schema compiled in this thread, or `ON_WORKER` when its JSON is larger than `threadSchemaBytes` (it would
 * hold this thread for milliseconds, a regular expression more: see README, "Every validation is bounded in time").
 * @throws {SchemaRefused} when `compileSchema` refuses `schema` (now or before: a refusal is cached).
 */
function compiledFor({ cache, limits }: Validation, key: string, schema: unknown): Exclude<Entry, SchemaRefused> {
  let entry = cache.get(key);
  if (!entry) {
    const json = JSON.stringify(schema);
    if (json.length > limits.threadSchemaBytes || costlyPatterns(json, limits.threadPatterns)) {
      entry = ON_WORKER;
    } else {
      // A copy of our own: the validator keeps (and annotates) the schema it compiles. Stored: it was checked
      // when it was PUT, perhaps by an earlier release's rules.
      const copy = structuredClone(schema);
      try {
        entry = costed(copy, compileSchema(copy, { stored: true }));
      } catch (error) {
        if (error instanceof SchemaRefused) cache.set(key, error);
        throw error;
      }
    }
    cache.set(key, entry);
  }
  if (entry instanceof SchemaRefused) throw entry;
  return entry;
}

/** A validation in this thread; one deeper than the stack is too costly, as on a Worker. */
function inThread({ limits }: Validation, entry: CostedSchema, instance: unknown): SchemaViolation[] {
  try {
    return entry.compiled.validate(instance);
  } catch (error) {
    if (error instanceof ValidationTooDeep) throw new ValidationTooCostly(limits.workerUnits, { cause: error });
    throw error;
  }
}

/** Sends `key`'s validation (or only its compilation, without `instance`) to a Worker. */
function onWorker(
  { cache, limits, pool }: Validation,
  tenant: string,
  { key, schema, instance }: { key: string; schema: unknown; instance?: unknown },
  signal?: AbortSignal,
): Promise<SchemaViolation[]> {
  /** Sends the message, with the schema when asked, and arms the deadline: `compileMs` for a schema to compile. */
  const send = (slot: PoolSlot<WorkerMemo>, id: number, withSchema: boolean) => {
    const message: ValidateMessage = { id, key };
    if (withSchema) message.schema = schema;
    if (instance !== undefined) message.instance = instance;
    slot.post(message);
    slot.data.sent.set(key, true);
    if (withSchema && (slot.data.compiledChars += JSON.stringify(schema).length) > limits.recycleChars) slot.retire();
    slot.arm(withSchema ? limits.compileMs : limits.deadlineMs);
  };
  return pool.run<SchemaViolation[]>(tenant, {
    begin: (slot, id) => send(slot, id, slot.data.sent.get(key) === undefined),
    reply(data, slot) {
      if (data.type === "missing") return void send(slot, data.id, true);
      // The Worker validates now: the deadline starts.
      if (data.type === "compiled") return void slot.arm(limits.deadlineMs);
      if (data.type === "result") {
        if (cache.get(key) === ON_WORKER) cache.set(key, COMPILES_ON_WORKER);
        return { value: data.violations };
      }
      if (data.type === "costly") return { error: new ValidationTooCostly(limits.workerUnits) };
      if (data.type === "refused") {
        slot.data.sent.delete(key);
        const refused = new SchemaRefused(data.pointer, data.reason);
        cache.set(key, refused);
        return { error: refused };
      }
      return { error: rebuildError(data.name, data.message) };
    },
    timedOut: (ms) => new ValidationTimeout(ms),
  }, signal);
}

/**
 * Whether a schema's regular expressions may be costly to compile, read from its JSON: more than `most` of them
 * (32 short ones in a 1 KB schema), a Unicode property class under a counted repetition (RE2 writes the class out
 * once per count: `[\p{L}\p{N}]{0,198}` ten times), more Unicode property classes than `most` (two patterns of
 * 165 `\p{L}` in a class), or counts adding up past 1,000; what each took to compile, against plain patterns, is
 * in the README, "Every validation is bounded in time". Text that only looks like one (in a description, say)
 * sends a schema to a Worker for nothing, which costs little.
 */
function costlyPatterns(json: string, most: number): boolean {
  if (json.split('"pattern').length - 1 > most) return true;
  let counts = 0;
  for (const [, min, comma, max] of json.matchAll(/\{(\d+)(,?)(\d*)\}/g)) {
    counts += Number(comma && max ? max : min);
  }
  const classes = json.split(/\\\\[pP]/).length - 1;
  return counts > 1_000 || (counts > 0 && classes > 0) || classes > most;
}

/** The tenant a validation key names: its first segment ("tenant/task/version/input"; "" for built-in tasks). */
function tenantOf(key: string): string {
  const slash = key.indexOf("/");
  return slash < 0 ? key : key.slice(0, slash);
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
