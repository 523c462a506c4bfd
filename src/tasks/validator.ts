/**
 * Validation of instances against tenants' schemas with a bound on the work
 * one validation can take. `compileSchema` refuses catastrophic regular
 * expressions, but what it accepts can still take seconds: a polynomial
 * pattern (`^\d+\d+\d+$` on a few KB), `uniqueItems` (quadratic), a `format`
 * whose regular expression backtracks (`url`), or in-place fan-out through
 * `$ref` (`anyOf` of two branches that recurse into a property: 2^depth).
 *
 * So a validation runs in the caller's thread only when it is known to be
 * small: no keyword whose cost is unbounded in one evaluation, and an
 * estimate (walking the schema over the instance as the validator does,
 * stopping at the budget) under `fastPathUnits`. Anything else runs on a
 * small pool of Web Workers (`validation_worker.ts`) under a deadline: a
 * Worker that runs over is terminated, that validation fails with
 * {@linkcode ValidationTimeout}, and a fresh Worker takes the next one.
 * Both sides cache compiled schemas per key.
 */
import { type CompiledSchema, compileSchema, resolvePointer, type SchemaViolation } from "./json_schema.ts";
import { Lru } from "./_lru.ts";
import type { InitMessage, ValidateMessage, WorkerReply } from "./validation_worker.ts";
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
   * Work a validation may be estimated at and still run in the caller's thread: one unit is a subschema
   * evaluated on one value, one keyword or array entry or key of either, or 64 characters of a string.
   * Measured, a unit took at most 0.55 µs of `@cfworker/json-schema` (2 µs for a string of "t"s against
   * `format: date-time`, which splits it at each one): so at most about 1 ms here, 4 ms in the worst case.
   */
  fastPathUnits: 2_000,
  /** Time a Worker may take to compile a schema it has not seen (bounded by `compileSchema`'s limits). */
  compileMs: 1_000,
  /** Web Workers validating at once. */
  workers: 2,
  /** How long a Worker may take to load before the validations waiting for it fail. */
  startMs: 10_000,
};

/** Raised when a validation would take longer than the deadline. */
export class ValidationTimeout extends Error {
  constructor(readonly deadlineMs: number, options?: ErrorOptions) {
    super(`Schema validation took longer than ${deadlineMs} ms`, options);
    this.name = "ValidationTimeout";
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
 * Validates, and asks again after a {@linkcode ValidationTimeout} while `deadline` leaves room for the wait and
 * one more try. A timeout is no verdict on the instance: a Worker starved of CPU (a busy host, the pool's other
 * Workers) runs over just as a costly instance does, so it is never reported as a violation. Each try keeps the
 * validator's own deadline, so a stalling instance holds a Worker no longer per try than before.
 * @returns the violations, as `validate` returns them.
 * @throws {DeadlineExceeded} when the tries kept timing out until `deadline` left no room (the last timeout
 * as its cause).
 * @throws whatever else `validate` throws, at once.
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
      if (!(error instanceof ValidationTimeout)) throw error;
      const waitMs = Math.round(
        random() * Math.min(VALIDATION_RETRY.capMs, VALIDATION_RETRY.baseMs * 2 ** (tries - 1)),
      );
      if (deadline.remaining() < waitMs + error.deadlineMs) {
        throw new DeadlineExceeded(`schema validation of ${key} timed out ${tries} times within the deadline`, {
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
   * @throws {SchemaRefused} when `compileSchema` refuses `schema`.
   */
  validate(key: string, schema: unknown, instance: unknown, tenant?: string): Promise<SchemaViolation[]>;
  /**
   * The fast path alone, without a wait: the violations when the validation is small enough for this
   * thread, undefined when it must go to a Worker (call `validate`).
   * @throws {SchemaRefused} when `compileSchema` refuses `schema`.
   */
  validateNow(key: string, schema: unknown, instance: unknown, units?: number): SchemaViolation[] | undefined;
  /** Terminates the Workers; validations still waiting or running reject. */
  close(): Promise<void>;
}

/** Options of {@linkcode createSchemaValidators}; each defaults to its {@linkcode VALIDATION_LIMITS} entry. */
export interface ValidatorOptions {
  deadlineMs?: number;
  cacheSize?: number;
  /** 0 sends every validation to a Worker. */
  fastPathUnits?: number;
  compileMs?: number;
  workers?: number;
  startMs?: number;
}

/** A compiled schema, what a validation of it may run in the caller's thread, and its subschemas' weights. */
interface Compiled {
  schema: unknown;
  compiled: CompiledSchema;
  /** Whether no keyword of it can cost more than linear time in one evaluation. */
  linear: boolean;
  weights: WeakMap<object, number>;
  /** Its weight: every subschema's, added up. */
  total: number;
  /** Whether it has no `$ref`: each subschema then applies at most once to each part of a value. */
  tree: boolean;
}

interface Job {
  id: number;
  key: string;
  schema: unknown;
  instance: unknown;
  resolve(violations: SchemaViolation[]): void;
  reject(error: unknown): void;
}

/** A Worker, the job it is running, and the keys it has been sent (mirroring its own cache). */
interface Slot {
  worker: Worker;
  ready: boolean;
  job?: Job;
  timer?: ReturnType<typeof setTimeout>;
  sent: Lru<string, true>;
}

const WORKER_URL = new URL("./validation_worker.ts", import.meta.url).href;

/**
 * Starts validators. Workers start on the first validation that needs one.
 *
 * A validation waits in its tenant's queue until a Worker is free (the tenant asking; by default the key's first
 * segment), and free Workers take from the tenants' queues in turn: a validation waits for those running and at
 * most one of each other waiting tenant's per turn, not for another tenant's whole burst. The deadline counts from when a
 * validation reaches a Worker, so a slow one delays those behind it by at most the deadline. A Worker runs one
 * validation at a time, so a timeout terminates only the validation that ran over; the queue goes on with a
 * fresh Worker.
 */
export function createSchemaValidators(options: ValidatorOptions = {}): SchemaValidators {
  const limits = { ...VALIDATION_LIMITS };
  for (const [name, value] of Object.entries(options) as [keyof ValidatorOptions, number | undefined][]) {
    if (value !== undefined) limits[name] = value;
  }
  if (!(limits.workers >= 1)) throw new RangeError(`At least one validation Worker (got ${limits.workers})`);
  const cache = new Lru<string, Compiled>(limits.cacheSize);
  const slots: Slot[] = [];
  const queue = createTenantQueues();
  let nextId = 0;
  let closed = false;

  const compiledFor = (key: string, schema: unknown): Compiled => {
    let entry = cache.get(key);
    if (!entry) {
      // A copy of our own: the validator keeps (and annotates) the schema it compiles.
      const copy = structuredClone(schema);
      entry = { schema: copy, compiled: compileSchema(copy), ...classify(copy) };
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
      // The Worker may be stuck in a backtracking regular expression: only terminating it stops that.
      remove(slot);
      job.reject(new ValidationTimeout(ms));
      start();
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
    const slot: Slot = { worker, ready: false, sent: new Lru(limits.cacheSize) };
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
    worker.postMessage({ type: "init", cacheSize: limits.cacheSize } satisfies InitMessage);
    slots.push(slot);
  };

  const pump = () => {
    if (closed) return;
    while (queue.size > 0) {
      const idle = slots.find((slot) => slot.ready && !slot.job);
      if (!idle) break;
      dispatch(idle, queue.next()!);
    }
    const starting = slots.filter((slot) => !slot.ready).length;
    if (queue.size > starting && slots.length < limits.workers) start();
  };

  return {
    validateNow(key, schema, instance, units) {
      if (closed) throw new Error("The schema validators are closed");
      const entry = compiledFor(key, schema);
      if (!entry.linear) return undefined;
      // Without references, no subschema applies twice to one part of the value: the schema's weight times
      // the value's size bounds the work, with no need to walk the two together.
      const bounded = entry.tree && units !== undefined && entry.total * units <= limits.fastPathUnits;
      return bounded || withinBudget(entry, instance, limits.fastPathUnits)
        ? entry.compiled.validate(instance)
        : undefined;
    },
    validate(key, schema, instance, tenant = tenantOf(key)) {
      if (closed) return Promise.reject(new Error("The schema validators are closed"));
      let entry: Compiled;
      try {
        entry = compiledFor(key, schema);
        if (entry.linear && withinBudget(entry, instance, limits.fastPathUnits)) {
          return Promise.resolve(entry.compiled.validate(instance));
        }
      } catch (error) {
        return Promise.reject(error);
      }
      return new Promise((resolve, reject) => {
        queue.push(tenant, { id: nextId++, key, schema: entry.schema, instance, resolve, reject });
        pump();
      });
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

/*
 * What `@cfworker/json-schema` 4.1.6 (dist/esm/validate.js) does per
 * evaluation of one subschema on one value: every keyword costs O(1) or the
 * size of the keyword's value (enum, const, required) or of the value's own
 * entries (Object.keys, one encodePointer per key), except `pattern` and
 * `patternProperties` (a tenant's regular expression), `uniqueItems` (every
 * pair of items), and the formats below. Evaluations multiply through the
 * applicators, which the estimate follows.
 */

/** Formats of `@cfworker/json-schema` whose regular expression or parse can cost more than linear time. */
const SUPERLINEAR_FORMATS = new Set(["uri", "uri-reference", "uri-template", "url", "regex"]);

/** Keywords whose value is data, never a subschema that is evaluated. */
const DATA = new Set(["enum", "const", "default", "examples"]);

/** Keywords whose value maps names (data) to subschemas. */
const SCHEMA_MAPS = new Set(["$defs", "definitions", "properties", "patternProperties", "dependentSchemas"]);

/** Keywords with one subschema, evaluated on the value itself. */
const IN_PLACE = ["not", "if", "then", "else"];
/** Keywords with a list of subschemas, each evaluated on the value itself. */
const IN_PLACE_LISTS = ["allOf", "anyOf", "oneOf"];
/** Keywords with a map of subschemas, each evaluated on the value itself (an object). */
const IN_PLACE_MAPS = ["dependentSchemas", "dependencies"];
/** Keywords with one subschema, evaluated on every property value of an object. */
const EVERY_PROPERTY = ["additionalProperties", "unevaluatedProperties"];
/** Keywords with one subschema, evaluated on every item of an array. */
const EVERY_ITEM = ["additionalItems", "contains", "unevaluatedItems"];

/**
 * Walks every object of a schema's JSON (but data keywords' values): whether it holds no keyword whose one
 * evaluation can cost more than linear time, and each object's weight (one, plus one per keyword, plus the
 * size of its data keywords' values).
 *
 * An `id` keyword (draft 4's `$id`, which the validator still follows) moves the base of references away
 * from what {@linkcode resolvePointer} resolves, so the estimate would follow other subschemas than the
 * validator does: such a schema always runs on a Worker.
 */
function classify(
  schema: unknown,
): { linear: boolean; weights: WeakMap<object, number>; total: number; tree: boolean } {
  const weights = new WeakMap<object, number>();
  let linear = true;
  let total = 0;
  let tree = true;
  const visit = (node: unknown): void => {
    if (typeof node !== "object" || node === null) return;
    if (Array.isArray(node)) return node.forEach(visit);
    let weight = 1;
    for (const [key, value] of Object.entries(node)) {
      weight += 1;
      if (
        (key === "pattern" && typeof value === "string") ||
        (key === "patternProperties" && typeof value === "object" && value !== null) ||
        (key === "uniqueItems" && value === true) ||
        (key === "format" && typeof value === "string" && SUPERLINEAR_FORMATS.has(value)) ||
        (key === "id" && typeof value === "string" && value !== "")
      ) {
        linear = false;
      }
      if (key === "$ref" || key === "$dynamicRef") tree = false;
      if (SCHEMA_MAPS.has(key) && typeof value === "object" && value !== null && !Array.isArray(value)) {
        // A map of names to subschemas: a name is data (a property may be called "default" or "pattern"),
        // its subschema is not.
        for (const [name, sub] of Object.entries(value)) {
          weight += 1 + Math.floor(name.length / CHARS_PER_UNIT);
          visit(sub);
        }
      } else if (DATA.has(key) || key === "required" || key === "dependentRequired") weight += jsonSize(value);
      else visit(value);
    }
    weights.set(node, weight);
    total += weight;
  };
  visit(schema);
  return { linear, weights, total, tree };
}

/** Values, keys and array entries in a JSON value. */
function jsonSize(value: unknown): number {
  if (typeof value !== "object" || value === null) return 1;
  let size = 1;
  for (const [, item] of Object.entries(value)) size += 1 + jsonSize(item);
  return size;
}

const CHARS_PER_UNIT = 64;

/** Thrown inside {@linkcode withinBudget} to stop the walk. */
const OVER_BUDGET = Symbol("over budget");

/**
 * Whether validating `instance` against a linear schema costs at most `budget` units: walks the
 * subschemas the validator would evaluate on each value, as it does (but every branch, even where the
 * validator may stop early), adding each evaluation's cost, and stops as soon as the sum exceeds `budget`.
 * So it runs in O(budget) whatever the schema and instance, and a validation under budget takes as long.
 */
function withinBudget(entry: Compiled, instance: unknown, budget: number): boolean {
  return estimate(entry, instance, budget) <= budget;
}

/** The estimated cost of validating `instance`, or Infinity past `budget`. */
function estimate(entry: Compiled, instance: unknown, budget: number): number {
  const { schema: root, weights } = entry;
  const entries = new WeakMap<object, number>();
  let units = 0;
  const spend = (n: number) => {
    units += n;
    if (units > budget) throw OVER_BUDGET;
  };
  /** A value's own cost per evaluation: its entries (keys and their pointers) or its characters. */
  const ownCost = (value: unknown): number => {
    if (typeof value === "string") return 1 + Math.floor(value.length / CHARS_PER_UNIT);
    if (typeof value !== "object" || value === null) return 1;
    let cost = entries.get(value);
    if (cost === undefined) {
      cost = 1;
      if (Array.isArray(value)) cost += value.length;
      else for (const key in value) cost += 1 + Math.floor(key.length / CHARS_PER_UNIT);
      entries.set(value, cost);
    }
    return cost;
  };
  const evaluate = (schema: unknown, value: unknown): void => {
    if (typeof schema !== "object" || schema === null) return spend(1);
    spend((weights.get(schema) ?? jsonSize(schema)) + ownCost(value));
    const s = schema as Record<string, unknown>;
    if (typeof s.$ref === "string") evaluate(resolvePointer(root, s.$ref), value);
    for (const k of IN_PLACE) if (k in s) evaluate(s[k], value);
    for (const k of IN_PLACE_LISTS) {
      if (Array.isArray(s[k])) {
        for (const sub of s[k] as unknown[]) evaluate(sub, value);
      }
    }
    if (typeof value !== "object" || value === null) return;
    if (Array.isArray(value)) {
      for (const k of ["prefixItems", "items"]) {
        if (Array.isArray(s[k])) (s[k] as unknown[]).forEach((sub, i) => i < value.length && evaluate(sub, value[i]));
      }
      for (const k of ["items", ...EVERY_ITEM]) {
        if (k in s && !Array.isArray(s[k])) { for (const item of value) evaluate(s[k], item); }
      }
      return;
    }
    const object = value as Record<string, unknown>;
    for (const k of IN_PLACE_MAPS) {
      const map = s[k];
      if (typeof map !== "object" || map === null) continue;
      for (const sub of Object.values(map)) if (!Array.isArray(sub)) evaluate(sub, value);
    }
    if (typeof s.properties === "object" && s.properties !== null) {
      for (const [key, sub] of Object.entries(s.properties)) if (Object.hasOwn(object, key)) evaluate(sub, object[key]);
    }
    for (const k of EVERY_PROPERTY) if (k in s) { for (const key in object) evaluate(s[k], object[key]); }
    if ("propertyNames" in s) { for (const key in object) evaluate(s.propertyNames, key); }
  };
  try {
    evaluate(root, instance);
    return units;
  } catch (error) {
    if (error === OVER_BUDGET) return Infinity;
    throw error;
  }
}
