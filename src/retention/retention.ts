/**
 * Retention: the service that deletes what the service no longer needs, on
 * its own interval, in batches (`DELETE ... WHERE id IN (SELECT ... LIMIT
 * batch)`) until a batch deletes fewer than the batch size, so no statement
 * holds many locks or runs long (River's `job_cleaner` is the model). Each
 * delete is its table's owner's: the outbox store's for sent rows, the job
 * store's for summaries, outcomes and model attempts, the cache-hit store's
 * for cache hits. The lifetimes are the caller's to hand in.
 *
 * Every relay replica runs the service, and one pass runs at a time across
 * them all: a pass holds a Postgres advisory lock (session-level, on a
 * connection reserved for it, so a replica that dies frees it with its
 * connection), and a replica that finds it held skips its pass. Between full
 * batches a pass pauses (`pauseMs`, jittered), so a large backlog is deleted
 * beside the service's own writes rather than ahead of them.
 */
import type { Sql } from "postgres";
import * as jobs from "../jobs/job_store.ts";
import * as cacheHits from "../cache/cache_hit_store.ts";
import type { Logger } from "../log/logger.ts";
import * as outbox from "../outbox/outbox_store.ts";

const DAY_MS = 24 * 3600 * 1000;

/** The advisory lock a pass holds: one pass at a time across every replica on the database. */
const PASS_LOCK = "oncely/retention";

/** Defaults of the optional {@linkcode RetentionOptions}. */
export const RETENTION_DEFAULTS = {
  /** How often a pass runs. */
  everyMs: 600_000,
  /** How long after {@linkcode Retention.start} the first pass runs: not in the way of a starting process. */
  firstPassAfterMs: 5_000,
  /** The most rows one DELETE statement removes. */
  batch: 1_000,
  /** The pause after a full batch, before the next (from half to one and a half times this). */
  pauseMs: 100,
  /** OUTBOX_RETENTION_S's default in ms: sent outbox rows older than this are deleted. */
  outboxRetentionMs: 7 * DAY_MS,
} as const;

/** Options for {@linkcode createRetention}; the defaults are {@linkcode RETENTION_DEFAULTS}. */
export interface RetentionOptions {
  /** OUTBOX_RETENTION_S in ms: sent outbox rows older than this are deleted. Unsent rows are kept. */
  outboxRetentionMs?: number;
  /**
   * SUMMARY_RETENTION_S in ms: summaries older than this are deleted, except those whose notification is still
   * unsent (pending or failed: the relay needs them). Unset, summaries (and outcome rows) are kept.
   */
  summaryRetentionMs?: number;
  /**
   * MODEL_ATTEMPTS_RETENTION_S in ms: the record of model attempts, and of cache hits, older than this is deleted;
   * unset, kept.
   */
  attemptRetentionMs?: number;
  /**
   * The least age at which a job's outcome row is deleted (with `summaryRetentionMs`): as long as anything may
   * still ask about the job (its Redis record, its dead letters), plus a day. The caller knows those lifetimes.
   */
  outcomeMinAgeMs: number;
  everyMs?: number;
  pauseMs?: number;
  firstPassAfterMs?: number;
  batch?: number;
  /** Called after each DELETE statement with its table and how many rows it deleted (for tests and metrics). */
  onBatch?: (table: string, rows: number) => void;
}

/** A retention service. */
export interface Retention {
  /** One pass: deletes everything past its age, batch after batch. @returns rows deleted in all. */
  runOnce(): Promise<number>;
  /** Runs a pass every `everyMs` (the first after `firstPassAfterMs`) until {@linkcode Retention.stop}. */
  start(): void;
  /** Stops the loop; a pass in progress ends after its current batch, and this waits for it. */
  stop(): Promise<void>;
}

/**
 * Creates the retention service. Running it in several processes at once is safe: one pass runs at a time (the
 * others skip theirs), and each delete is idempotent besides.
 */
export function createRetention({ sql, log }: { sql: Sql; log: Logger }, options: RetentionOptions): Retention {
  const batch = options.batch ?? RETENTION_DEFAULTS.batch;
  const pauseMs = options.pauseMs ?? RETENTION_DEFAULTS.pauseMs;
  const outboxAgeMs = options.outboxRetentionMs ?? RETENTION_DEFAULTS.outboxRetentionMs;

  /** Set by {@linkcode Retention.stop}: a pass in progress ends after its current batch. */
  let halted = false;
  /** Ends a pause at once when the service stops. */
  let wake: (() => void) | undefined;
  const pause = () =>
    new Promise<void>((resolve) => {
      const timer = setTimeout(done, pauseMs * (0.5 + Math.random()));
      function done() {
        clearTimeout(timer);
        wake = undefined;
        resolve();
      }
      wake = done;
    });
  /** Rows deleted per table in the current pass, for its log line. */
  const deletedPerTable: Record<string, number> = {};

  /** Runs `deleteBatch` until it deletes fewer than a batch (or the service stops). @returns rows deleted. */
  async function drain(table: string, deleteBatch: (limit: number) => Promise<number>): Promise<number> {
    let total = 0;
    while (!halted) {
      const deleted = await deleteBatch(batch);
      options.onBatch?.(table, deleted);
      deletedPerTable[table] = (deletedPerTable[table] ?? 0) + deleted;
      total += deleted;
      if (deleted < batch || halted) break;
      if (pauseMs > 0) await pause();
    }
    return total;
  }

  /** One pass if no other replica's is running: @returns rows deleted (0 when it skipped). */
  async function runOnce(): Promise<number> {
    const connection = await sql.reserve();
    try {
      const [row] = await connection<{ locked: boolean }[]>`
        SELECT pg_try_advisory_lock(hashtextextended(${PASS_LOCK}, 0)) AS locked`;
      if (!row!.locked) {
        log.debug("retention_skipped", { reason: "another replica's pass is running" });
        return 0;
      }
      try {
        return await deleteAll();
      } finally {
        await connection`SELECT pg_advisory_unlock(hashtextextended(${PASS_LOCK}, 0))`;
      }
    } finally {
      connection.release();
    }
  }

  async function deleteAll(): Promise<number> {
    let total = await drain("outbox", (limit) => outbox.deleteSentRows(sql, { olderThanMs: outboxAgeMs, limit }));
    const attemptAgeMs = options.attemptRetentionMs;
    if (attemptAgeMs !== undefined) {
      total += await drain(
        "model_attempts",
        (limit) => jobs.deleteExpiredAttempts(sql, { olderThanMs: attemptAgeMs, limit }),
      );
      // The record of cache hits (what each saved) is kept as long as the record of the calls it stands for.
      total += await drain(
        "cache_hits",
        (limit) => cacheHits.deleteExpiredCacheHits(sql, { olderThanMs: attemptAgeMs, limit }),
      );
    }
    const summaryAgeMs = options.summaryRetentionMs;
    if (summaryAgeMs === undefined) return total;
    // Summaries whose notification is still unsent stay: the email (or webhook) needs them.
    // The job's outcome row stays longer (below): it keeps a finished job finished, so a late DELETE
    // still gets 409 and a replayed message still skips the model, after the summary is gone.
    total += await drain("summaries", (limit) =>
      jobs.deleteExpiredSummaries(sql, {
        olderThanMs: summaryAgeMs,
        limit,
        keep: (jobId) => outbox.hasUnsentRowOf(sql, jobId),
      }));
    // A task run's input and output live as long as a summary does, on the same rule.
    total += await drain("run_results", (limit) =>
      jobs.deleteExpiredRunResults(sql, {
        olderThanMs: summaryAgeMs,
        limit,
        keep: (runId) => outbox.hasUnsentRowOf(sql, runId),
      }));
    // Outcome rows outlive their summaries until nothing can ask about the job any more: the job's Redis
    // record (7 days after its message left its lane) and its idempotency record (at most SUMMARY_RETENTION_S) are
    // gone by then. A message still waiting in its lane after that (a job cancelled while it waited for weeks) is
    // told by its record, which lives as long as it waits (the worker asks it of messages over 7 days old).
    const outcomeAgeMs = Math.max(summaryAgeMs, options.outcomeMinAgeMs);
    total += await drain(
      "job_outcomes",
      (limit) => jobs.deleteExpiredOutcomes(sql, { olderThanMs: outcomeAgeMs, limit }),
    );
    return total;
  }

  let timer: ReturnType<typeof setTimeout> | undefined;
  let passing: Promise<void> | undefined;
  let stopped = true;

  async function pass(): Promise<void> {
    try {
      for (const table of Object.keys(deletedPerTable)) delete deletedPerTable[table];
      const deleted = await runOnce();
      if (deleted > 0) log.info("retention_deleted", { rows: deleted, ...deletedPerTable });
    } catch (error) {
      log.warn("retention_pass_failed", { error });
    }
  }

  function schedule(ms: number): void {
    timer = setTimeout(() => {
      passing = pass().finally(() => {
        passing = undefined;
        if (!stopped) schedule(options.everyMs ?? RETENTION_DEFAULTS.everyMs);
      });
    }, ms);
  }

  return {
    runOnce,
    start() {
      if (!stopped) return;
      stopped = false;
      halted = false;
      schedule(options.firstPassAfterMs ?? RETENTION_DEFAULTS.firstPassAfterMs);
    },
    async stop() {
      stopped = true;
      halted = true;
      wake?.();
      clearTimeout(timer);
      await passing;
    },
  };
}
