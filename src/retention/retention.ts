/**
 * Retention: the service that deletes what the service no longer needs, on
 * its own interval, in batches (`DELETE ... WHERE id IN (SELECT ... LIMIT
 * batch)`) until a batch deletes fewer than the batch size, so no statement
 * holds many locks or runs long (River's `job_cleaner` is the model). Each
 * delete is its table's owner's: the outbox store's for sent rows, the job
 * store's for summaries, outcomes and model attempts, the cache-hit store's
 * for cache hits, the tenant change log's for its rows. The lifetimes are the caller's to hand in.
 *
 * Every relay replica runs the service, and one pass runs at a time across
 * them all: a pass holds a Postgres session advisory lock and runs every
 * statement in the session that holds it, and a replica that finds the lock
 * held skips its pass until its next tick. A replica that dies frees the lock
 * with its connection. Between full batches a pass pauses (`pauseMs`,
 * jittered), so a large backlog is deleted beside the service's own writes
 * rather than ahead of them.
 */
import type { ReservedSql, Sql, TransactionSql } from "postgres";
import { sleep } from "../async/timeout.ts";
import * as cacheHits from "../cache/cache_hit_store.ts";
import * as jobs from "../jobs/job_store.ts";
import type { Logger } from "../log/logger.ts";
import * as outbox from "../outbox/outbox_store.ts";
import { deleteOldChanges } from "../tenants/tenant_changes.ts";

const DAY_MS = 24 * 3600 * 1000;

/** The advisory lock a pass holds (as `hashtextextended(PASS_LOCK, 0)`): one pass at a time on the database. */
const PASS_LOCK = "oncely/retention";

/** Defaults of the optional {@linkcode RetentionOptions}. */
export const RETENTION_DEFAULTS = {
  /** How often a pass runs (or, on a replica that finds another's pass running, is skipped). */
  everyMs: 600_000,
  /** How long after {@linkcode Retention.start} the first pass runs: not in the way of a starting process. */
  firstPassAfterMs: 5_000,
  /** The most rows one DELETE statement removes. */
  batch: 1_000,
  /** The pause after a full batch, before the next: from half to one and a half times this (75-225 ms). */
  pauseMs: 150,
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
  /**
   * How long the tenant change log (migration 022) keeps a row: the relay passes `CHANGES_KEPT_MS`, an hour (the
   * API's caches look at it every few seconds). Unset, kept.
   */
  tenantChangesRetentionMs?: number;
  everyMs?: number;
  pauseMs?: number;
  firstPassAfterMs?: number;
  batch?: number;
  /** Uniform random in [0, 1), for the pauses' jitter. */
  random?: () => number;
  /** Waits out a pause: resolves after `ms`, or sooner once `signal` aborts (the service is stopping). */
  sleep?: (ms: number, signal: AbortSignal) => Promise<void>;
  /** Called after each DELETE statement with its table and how many rows it deleted (for tests and metrics). */
  onBatch?: (table: string, rows: number) => void;
  /** Called between a batch's lock check and its delete (for crash tests). */
  onLockChecked?: (table: string) => Promise<void>;
}

/** A retention service. */
export interface Retention {
  /**
   * One pass, unless another is running (this replica's or another's): deletes everything past its age, batch
   * after batch. @returns rows deleted in all (0 when it skipped).
   * @throws when a statement fails, or when the pass finds its lock lost (its connection was replaced).
   */
  runOnce(): Promise<number>;
  /** Runs a pass every `everyMs` (the first after `firstPassAfterMs`) until {@linkcode Retention.stop}. */
  start(): void;
  /** Stops the loop; a pass in progress ends after its current batch (or its pause), and this waits for it. */
  stop(): Promise<void>;
}

/** One pass's session: the connection that holds the lock and runs every statement of the pass. */
interface Pass {
  db: Sql;
  signal: AbortSignal;
  options: RetentionOptions;
  batch: number;
  pauseMs: number;
  random: () => number;
  pause: (ms: number, signal: AbortSignal) => Promise<void>;
  /** Rows deleted per table, for the pass's log line. */
  deleted: Record<string, number>;
}

/** Whether `db`'s session still holds the pass lock: a connection lost mid-pass is replaced by one without it. */
async function holdsLock(db: Sql | TransactionSql): Promise<boolean> {
  const [row] = await db<{ held: boolean }[]>`
    SELECT EXISTS (
      SELECT 1 FROM pg_locks
      WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted AND objsubid = 1
        AND ((classid::bigint << 32) | objid::bigint) = hashtextextended(${PASS_LOCK}, 0)
    ) AS held`;
  return row!.held;
}

/**
 * Runs one batch on the pass's session after checking that the session still holds the pass lock: another
 * replica may hold it by now if this session was lost, and then its pass runs, not this one. On a client of its
 * own (`begin`), the check and the batch are one transaction, so they run on one backend: a connection replaced
 * between them fails the transaction instead of deleting without the lock. A reserved connection (tests) has
 * no `begin`; it is never replaced, only lost, and then the batch fails.
 */
async function underLock(pass: Pass, table: string, batch: (db: Sql) => Promise<number>): Promise<number> {
  const checked = async (tx: Sql | TransactionSql) => {
    if (!await holdsLock(tx)) {
      throw new Error(`Retention's pass lost its advisory lock (its connection was lost) before a batch of ${table}`);
    }
    await pass.options.onLockChecked?.(table);
    return await batch(tx as Sql);
  };
  if (typeof pass.db.begin !== "function") return await checked(pass.db);
  return await pass.db.begin((tx) => checked(tx)) as number;
}

/** Runs `deleteBatch` until it deletes fewer than a batch (or the service stops). @returns rows deleted. */
async function drain(
  pass: Pass,
  table: string,
  deleteBatch: (db: Sql, limit: number) => Promise<number>,
): Promise<number> {
  let total = 0;
  while (!pass.signal.aborted) {
    const deleted = await underLock(pass, table, (db) => deleteBatch(db, pass.batch));
    pass.options.onBatch?.(table, deleted);
    pass.deleted[table] = (pass.deleted[table] ?? 0) + deleted;
    total += deleted;
    if (deleted < pass.batch || pass.signal.aborted) break;
    if (pass.pauseMs > 0) await pass.pause(pass.pauseMs * (0.5 + pass.random()), pass.signal);
  }
  return total;
}

async function deleteAll(pass: Pass, outboxAgeMs: number): Promise<number> {
  const { options } = pass;
  let total = await drain(
    pass,
    "outbox",
    (db, limit) => outbox.deleteSentRows(db, { olderThanMs: outboxAgeMs, limit }),
  );
  const changesAgeMs = options.tenantChangesRetentionMs;
  if (changesAgeMs !== undefined) {
    total += await drain(
      pass,
      "tenant_changes",
      (db, limit) => deleteOldChanges(db, { olderThanMs: changesAgeMs, limit }),
    );
  }
  const attemptAgeMs = options.attemptRetentionMs;
  if (attemptAgeMs !== undefined) {
    total += await drain(
      pass,
      "model_attempts",
      (db, limit) => jobs.deleteExpiredAttempts(db, { olderThanMs: attemptAgeMs, limit }),
    );
    // The record of cache hits (what each saved) is kept as long as the record of the calls it stands for.
    total += await drain(
      pass,
      "cache_hits",
      (db, limit) => cacheHits.deleteExpiredCacheHits(db, { olderThanMs: attemptAgeMs, limit }),
    );
  }
  const summaryAgeMs = options.summaryRetentionMs;
  if (summaryAgeMs === undefined) return total;
  // Summaries whose notification is still unsent stay: the email (or webhook) needs them.
  // The job's outcome row stays longer (below): it keeps a finished job finished, so a late DELETE
  // still gets 409 and a replayed message still skips the model, after the summary is gone.
  total += await drain(pass, "summaries", (db, limit) =>
    jobs.deleteExpiredSummaries(db, {
      olderThanMs: summaryAgeMs,
      limit,
      keep: (jobId) => outbox.hasUnsentRowOf(db, jobId),
    }));
  // A task run's input and output live as long as a summary does, on the same rule.
  total += await drain(pass, "run_results", (db, limit) =>
    jobs.deleteExpiredRunResults(db, {
      olderThanMs: summaryAgeMs,
      limit,
      keep: (runId) => outbox.hasUnsentRowOf(db, runId),
    }));
  // Outcome rows outlive their summaries until nothing can ask about the job any more: the job's Redis
  // record (7 days after its message left its lane) and its idempotency record (at most SUMMARY_RETENTION_S) are
  // gone by then. A message still waiting in its lane after that (a job cancelled while it waited for weeks) is
  // told by its record, which lives as long as it waits (the worker asks it of messages over 7 days old).
  const outcomeAgeMs = Math.max(summaryAgeMs, options.outcomeMinAgeMs);
  total += await drain(
    pass,
    "job_outcomes",
    (db, limit) => jobs.deleteExpiredOutcomes(db, { olderThanMs: outcomeAgeMs, limit }),
  );
  return total;
}

/**
 * Creates the retention service. Running it in several processes at once is safe: one pass runs at a time (the
 * others skip theirs), and each delete is idempotent besides.
 *
 * `sql` is where the passes run. Give it a client of one connection of its own (`max: 1`), as the relay process
 * does: a pass then runs on that connection, and if the connection is lost postgres.js opens another for the next
 * statement, which the pass's lock check notices. Given a pool, each pass reserves one of its connections
 * instead, which is fine for tests but not where a backend may die: postgres.js 3.4.9 throws an uncaught
 * TypeError, ending the process, on a statement sent to a reserved connection whose backend has gone
 * (porsager/postgres#1208), as every backend does in a failover.
 */
export function createRetention({ sql, log }: { sql: Sql; log: Logger }, options: RetentionOptions): Retention {
  const batch = options.batch ?? RETENTION_DEFAULTS.batch;
  const pauseMs = options.pauseMs ?? RETENTION_DEFAULTS.pauseMs;
  const outboxAgeMs = options.outboxRetentionMs ?? RETENTION_DEFAULTS.outboxRetentionMs;
  const random = options.random ?? Math.random;
  const pause = options.sleep ?? ((ms, signal) => sleep(ms, signal).catch(() => {}));

  /** Aborted by {@linkcode Retention.stop}: a pass in progress ends after its current batch or pause. */
  let stopping = new AbortController();
  /** Whether a pass of this instance is running: on a one-connection client the session lock would let in a second. */
  let running = false;

  async function runOnce(): Promise<number> {
    if (running) {
      log.debug("retention_skipped", { reason: "this replica's own pass is running" });
      return 0;
    }
    running = true;
    let reserved: ReservedSql | undefined;
    try {
      if (sql.options.max !== 1) reserved = await sql.reserve();
      const db = reserved ?? sql;
      const [row] = await db<{ locked: boolean }[]>`
        SELECT pg_try_advisory_lock(hashtextextended(${PASS_LOCK}, 0)) AS locked`;
      if (!row!.locked) {
        log.debug("retention_skipped", { reason: "another replica's pass is running" });
        return 0;
      }
      try {
        const pass: Pass = {
          db,
          signal: stopping.signal,
          options,
          batch,
          pauseMs,
          random,
          pause,
          deleted: {},
        };
        const deleted = await deleteAll(pass, outboxAgeMs);
        if (deleted > 0) log.info("retention_deleted", { rows: deleted, ...pass.deleted });
        return deleted;
      } finally {
        // A lost session took the lock with it (this unlock then finds none); a live one goes back without it.
        await db`SELECT pg_advisory_unlock(hashtextextended(${PASS_LOCK}, 0))`.catch((error) =>
          log.debug("retention_unlock_failed", { error })
        );
      }
    } finally {
      reserved?.release();
      running = false;
    }
  }

  let timer: ReturnType<typeof setTimeout> | undefined;
  let passing: Promise<void> | undefined;
  let stopped = true;

  function schedule(ms: number): void {
    timer = setTimeout(() => {
      passing = runOnce()
        .then(() => {}, (error) => log.warn("retention_pass_failed", { error }))
        .finally(() => {
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
      schedule(options.firstPassAfterMs ?? RETENTION_DEFAULTS.firstPassAfterMs);
    },
    async stop() {
      stopped = true;
      stopping.abort();
      clearTimeout(timer);
      await passing;
      // A pass run later (runOnce) runs whole again.
      stopping = new AbortController();
    },
  };
}
