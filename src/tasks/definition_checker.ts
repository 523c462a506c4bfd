/**
 * Checks of new task definitions off the thread that serves requests. A
 * definition's check compiles its two schemas (up to 64 KiB each) against
 * the meta-schemas and walks its templates: 68-106 ms of CPU measured for
 * the largest the limits allow, which on the API's thread would hold every
 * other tenant's requests for as long. So each check runs on a Web Worker
 * (`definition_worker.ts`) under a deadline counted from when the Worker
 * takes it: a Worker that runs over is terminated (a check runs no tenant
 * regular expression over tenant text, only compiles them, so termination
 * stops it) and the check fails with {@linkcode DefinitionCheckTimeout}.
 * Checks waiting for a Worker wait in a queue per tenant, taken in turn, and
 * at most `maxWaiting` wait in all.
 */
import { DefinitionRefused } from "./definition_check.ts";
import type { CheckMessage, CheckReply } from "./definition_worker.ts";

/** Defaults of {@linkcode createDefinitionChecker}. */
export const DEFINITION_CHECK = {
  /** Wall-clock time one check may take on a Worker, from when the Worker takes it: 10-15x the largest's CPU. */
  deadlineMs: 1_000,
  /** Workers checking at once. */
  workers: 1,
  /** Checks that may wait for a Worker, across tenants; one more is refused with {@linkcode DefinitionCheckBusy}. */
  maxWaiting: 100,
  /** How long a Worker may take to load before the checks waiting for it fail. */
  startMs: 10_000,
  /**
   * A Worker with nothing to check for this long is stopped (the next PUT starts one again, in tens of ms): PUTs of
   * new versions are rare, and a live Worker keeps its process from exiting when nobody closes the checker.
   */
  idleMs: 5_000,
};

/** Options of {@linkcode createDefinitionChecker}; each defaults to its {@linkcode DEFINITION_CHECK} entry. */
export type DefinitionCheckOptions = Partial<typeof DEFINITION_CHECK>;

/** A check that ran past the deadline: the definition is refused for it. */
export class DefinitionCheckTimeout extends Error {
  constructor(readonly deadlineMs: number) {
    super(`Checking the definition took longer than ${deadlineMs} ms; simplify its schemas`);
    this.name = "DefinitionCheckTimeout";
  }
}

/** Too many checks are waiting for a Worker: try again shortly. */
export class DefinitionCheckBusy extends Error {
  constructor(readonly waiting: number) {
    super(`${waiting} task definitions are waiting to be checked; try again in a second`);
    this.name = "DefinitionCheckBusy";
  }
}

/** Checks definitions on Web Workers. */
export interface DefinitionChecker {
  /**
   * Checks `definition` (its JSON text, as `JSON.stringify` or `canonicalJson` writes it) for `tenant`.
   * @throws {DefinitionRefused} naming the place and the reason.
   * @throws {DefinitionCheckTimeout} when the check ran past the deadline.
   * @throws {DefinitionCheckBusy} when `maxWaiting` checks are waiting already.
   */
  check(json: string, tenant: string): Promise<void>;
  /** Terminates the Workers; checks still waiting or running reject. */
  close(): Promise<void>;
}

interface Job {
  id: number;
  json: string;
  resolve(): void;
  reject(error: unknown): void;
}

interface Slot {
  worker: Worker;
  ready: boolean;
  job?: Job;
  timer?: ReturnType<typeof setTimeout>;
}

const WORKER_URL = new URL("./definition_worker.ts", import.meta.url).href;

/** Starts a checker; its Workers start on the first check. */
export function createDefinitionChecker(options: DefinitionCheckOptions = {}): DefinitionChecker {
  const limits = { ...DEFINITION_CHECK };
  for (const [name, value] of Object.entries(options) as [keyof typeof DEFINITION_CHECK, number | undefined][]) {
    if (value !== undefined) limits[name] = value;
  }
  if (!(limits.workers >= 1)) throw new RangeError(`At least one definition Worker (got ${limits.workers})`);
  const slots: Slot[] = [];
  // In turn order: a tenant served goes to the back; one whose queue empties leaves.
  const waiting = new Map<string, Job[]>();
  let size = 0;
  let nextId = 0;
  let closed = false;
  let idleTimer: ReturnType<typeof setTimeout> | undefined;

  /** Stops the Workers once nothing has been checked for `idleMs` (the timer itself keeps nothing alive). */
  const retireWhenIdle = () => {
    clearTimeout(idleTimer);
    idleTimer = undefined;
    if (closed || size > 0 || slots.length === 0 || slots.some((slot) => slot.job || !slot.ready)) return;
    const timer = setTimeout(() => {
      idleTimer = undefined;
      if (size > 0) return;
      for (const slot of [...slots]) if (slot.ready && !slot.job) remove(slot);
    }, limits.idleMs);
    Deno.unrefTimer(timer);
    idleTimer = timer;
  };

  const take = (): Job | undefined => {
    const first = waiting.entries().next();
    if (first.done) return undefined;
    const [tenant, jobs] = first.value;
    const job = jobs.shift()!;
    waiting.delete(tenant);
    if (jobs.length > 0) waiting.set(tenant, jobs);
    size--;
    return job;
  };

  const failWaiting = (error: Error) => {
    for (const jobs of waiting.values()) for (const job of jobs) job.reject(error);
    waiting.clear();
    size = 0;
  };

  const remove = (slot: Slot) => {
    clearTimeout(slot.timer);
    slot.worker.terminate();
    slots.splice(slots.indexOf(slot), 1);
  };

  const finish = (slot: Slot): Job | undefined => {
    const job = slot.job;
    clearTimeout(slot.timer);
    slot.timer = undefined;
    slot.job = undefined;
    return job;
  };

  const start = () => {
    const worker = new Worker(WORKER_URL, { type: "module", name: "definition-check" });
    const slot: Slot = { worker, ready: false };
    slot.timer = setTimeout(() => {
      remove(slot);
      if (!slots.some((other) => other.ready)) {
        failWaiting(new Error(`The definition check Worker did not start within ${limits.startMs} ms`));
      }
      pump();
    }, limits.startMs);
    worker.onmessage = ({ data }: MessageEvent<CheckReply>) => {
      if (data.type === "ready") {
        clearTimeout(slot.timer);
        slot.timer = undefined;
        slot.ready = true;
        return pump();
      }
      if (slot.job?.id !== data.id) return;
      const job = finish(slot)!;
      if (data.type === "passed") job.resolve();
      else if (data.type === "refused") job.reject(new DefinitionRefused(data.pointer, data.message));
      else job.reject(Object.assign(new Error(data.message), { name: data.name }));
      pump();
    };
    worker.onerror = (event) => {
      // Unhandled, a Worker's error would end this process.
      event.preventDefault();
      const job = finish(slot);
      const failed = new Error(`The definition check Worker failed: ${event.message}`);
      const loaded = slot.ready;
      remove(slot);
      if (job) job.reject(failed);
      // One that never loaded (a missing read permission, say) fails those waiting instead of retrying for ever.
      else if (!loaded && !slots.some((other) => other.ready)) failWaiting(failed);
      pump();
    };
    slots.push(slot);
  };

  const dispatch = (slot: Slot, job: Job) => {
    slot.job = job;
    slot.worker.postMessage({ id: job.id, json: job.json } satisfies CheckMessage);
    slot.timer = setTimeout(() => {
      // Only terminating the Worker stops a check that runs over; the next check gets a fresh one.
      finish(slot);
      remove(slot);
      job.reject(new DefinitionCheckTimeout(limits.deadlineMs));
      pump();
    }, limits.deadlineMs);
  };

  const pump = () => {
    if (closed) return;
    while (size > 0) {
      const idle = slots.find((slot) => slot.ready && !slot.job);
      if (!idle) break;
      dispatch(idle, take()!);
    }
    const starting = slots.filter((slot) => !slot.ready).length;
    if (size > starting && slots.length < limits.workers) start();
    retireWhenIdle();
  };

  return {
    check(json, tenant) {
      if (closed) return Promise.reject(new Error("The definition checker is closed"));
      if (size >= limits.maxWaiting) return Promise.reject(new DefinitionCheckBusy(size));
      return new Promise((resolve, reject) => {
        const job: Job = { id: nextId++, json, resolve, reject };
        const jobs = waiting.get(tenant);
        if (jobs) jobs.push(job);
        else waiting.set(tenant, [job]);
        size++;
        pump();
      });
    },
    close() {
      if (closed) return Promise.resolve();
      closed = true;
      clearTimeout(idleTimer);
      const error = new Error("The definition checker is closed");
      for (const slot of [...slots]) {
        const job = finish(slot);
        remove(slot);
        job?.reject(error);
      }
      failWaiting(error);
      return Promise.resolve();
    },
  };
}
