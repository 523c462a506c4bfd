/**
 * Checks of new task definitions off the thread that serves requests. A
 * definition's check compiles its two schemas (up to 64 KiB each) against
 * the meta-schemas and walks its templates, and for the largest the limits
 * allow that CPU time (measured in the README, "Defining a task") would, on
 * the API's thread, hold every other tenant's requests for as long. So each
 * check runs on a Web Worker
 * (`definition_worker.ts`, in a `worker_pool.ts` pool) under a deadline
 * counted from when the Worker takes it: a Worker that runs over is
 * terminated and the check fails with {@linkcode DefinitionCheckTimeout}.
 * A check runs no tenant regular expression over tenant text, only compiles
 * them and probes their shapes within a fixed budget, so a terminated Worker
 * ends soon after; the pool counts it until it has. Checks waiting for a
 * Worker wait in a queue per tenant, taken in turn, and are capped per
 * tenant and in all.
 */
import { DefinitionRefused } from "./definition_check.ts";
import type { CheckMessage, CheckReply } from "./definition_worker.ts";
import { createWorkerPool } from "./worker_pool.ts";
import type { PoolIsolation } from "./pool_channels.ts";

/** Defaults of {@linkcode createDefinitionChecker}. */
export const DEFINITION_CHECK = {
  /** Wall-clock time one check may take on a Worker, from when the Worker takes it: 10-15x the largest's CPU. */
  deadlineMs: 1_000,
  /** Workers checking at once, counting terminated ones still finishing a check. */
  workers: 1,
  /** Checks of one tenant waiting or running: its PUT burst (`TASK_PUT_BURST`'s default). */
  maxPendingPerTenant: 20,
  /** Checks waiting or running, across tenants; one more is refused with {@linkcode DefinitionCheckBusy}. */
  maxWaiting: 100,
  /** How long a Worker may take to load before the checks waiting for it fail. */
  startMs: 10_000,
  /**
   * A Worker with nothing to check for this long is stopped (the next PUT starts one again, in tens of ms): PUTs of
   * new versions are rare, and a live Worker keeps its process from exiting when nobody closes the checker.
   */
  idleMs: 5_000,
  /** How long a terminated Worker counts against the pool at most, should it never say it has finished. */
  orphanMs: 600_000,
  /**
   * Definition JSON a Worker may check before it is stopped (once its check is done) and a fresh one takes its
   * place: its heap grows with what it compiles and never shrinks. 4 MiB is 16 of the largest definitions.
   */
  recycleChars: 4 * 1024 * 1024,
  /** A checking child process's V8 heap cap, in MiB: past it the child ends, and only its check fails. */
  heapMiB: 128,
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

/** Too many checks are waiting for a Worker, the tenant's or everyone's: try again shortly. */
export class DefinitionCheckBusy extends Error {
  constructor(what: string) {
    super(`Too many task definitions are waiting to be checked (${what}); try again in a second`);
    this.name = "DefinitionCheckBusy";
  }
}

/** Checks definitions on Web Workers. */
export interface DefinitionChecker {
  /**
   * Checks `definition` (its JSON text, as `JSON.stringify` or `canonicalJson` writes it) for `tenant`.
   * @throws {DefinitionRefused} naming the place and the reason.
   * @throws {DefinitionCheckTimeout} when the check ran past the deadline.
   * @throws {DefinitionCheckBusy} when the tenant, or everyone, has too many checks waiting already.
   */
  check(json: string, tenant: string): Promise<void>;
  /** What the pool holds now (as `WorkerPool.stats`). */
  pool(): { workers: number; orphans: number; pending: number };
  /** Terminates the Workers; checks still waiting or running reject. */
  close(): Promise<void>;
}

const WORKER_URL = new URL("./definition_worker.ts", import.meta.url).href;

/** Starts a checker; its Workers start on the first check. */
export function createDefinitionChecker(
  { isolation, ...options }: DefinitionCheckOptions & { isolation?: PoolIsolation } = {},
): DefinitionChecker {
  const limits = { ...DEFINITION_CHECK };
  for (const [name, value] of Object.entries(options) as [keyof typeof DEFINITION_CHECK, number | undefined][]) {
    if (value !== undefined) limits[name] = value;
  }
  const pool = createWorkerPool<{ checkedChars: number }, CheckReply>({
    url: WORKER_URL,
    name: "definition-check",
    workers: limits.workers,
    startMs: limits.startMs,
    orphanMs: limits.orphanMs,
    idleMs: limits.idleMs,
    maxPendingPerTenant: limits.maxPendingPerTenant,
    maxPending: limits.maxWaiting,
    slotData: () => ({ checkedChars: 0 }),
    busy: (what) => new DefinitionCheckBusy(what),
    title: "definition check",
    isolation,
    heapMiB: limits.heapMiB,
  });
  let closed = false;
  return {
    check(json, tenant) {
      if (closed) return Promise.reject(new Error("The definition checker is closed"));
      return pool.run<void>(tenant, {
        begin(slot, id) {
          slot.post({ id, json } satisfies CheckMessage);
          if ((slot.data.checkedChars += json.length) > limits.recycleChars) slot.retire();
          slot.arm(limits.deadlineMs);
        },
        reply(data) {
          if (data.type === "passed") return { value: undefined };
          if (data.type === "refused") return { error: new DefinitionRefused(data.pointer, data.message) };
          return { error: Object.assign(new Error(data.message), { name: data.name }) };
        },
        timedOut: (ms) => new DefinitionCheckTimeout(ms),
      });
    },
    pool: () => pool.stats(),
    async close() {
      closed = true;
      await pool.close();
    },
  };
}
