import type { Sql } from "postgres";
import {
  RUN_EMAIL_TOPIC,
  RUN_KEY_PREFIX,
  RUN_WEBHOOK_TOPIC,
  SUMMARY_READY_KEY_PREFIX,
  SUMMARY_READY_TOPIC,
  SUMMARY_WEBHOOK_KEY_PREFIX,
  SUMMARY_WEBHOOK_TOPIC,
} from "./shapes.ts";
import { createBatcher } from "../async/batcher.ts";
import * as jobs from "../jobs/job_store.ts";
import type { Outcome } from "../jobs/job_store.ts";
import type { Logger } from "../log/logger.ts";
import * as outbox from "../outbox/outbox_store.ts";
import { type CacheHit, type CacheHitRow, insertCacheHitsOf } from "../cache/cache_hit_store.ts";
import { publicError } from "./public_error.ts";

/** Where a job's result goes: an email address, or a webhook URL. */
export type Notify = string | { webhook: string };

/** A finished summary ready to commit, with what its notification needs. */
export interface SummaryResult {
  jobId: string;
  tenant: string;
  summary: string;
  notify: Notify;
  /** The committing delivery's trace context: the relay's send continues that trace. */
  traceparent?: string;
  /** When the job was accepted (its stream entry's time, epoch ms), for the console's latency chart. */
  acceptedMs?: number;
  /** Set when the summary is a cached one: its `cache_hits` row is written in the commit's transaction. */
  cacheHit?: CacheHit;
}

/** A finished task run ready to commit: its output, what it ran, and where its notification goes (if anywhere). */
export interface TaskRunResult extends jobs.RunOf {
  jobId: string;
  tenant: string;
  input: unknown;
  /** The parsed JSON value (with an output schema) or the text. */
  output: unknown;
  /** The model asked. */
  model: string | null;
  notify?: Notify;
  traceparent?: string;
  acceptedMs?: number;
  /** Set when the output is a cached one (`run_results.cached`): its `cache_hits` row is written with it. */
  cacheHit?: CacheHit;
  /** The committing delivery's tokens, kept with the result (`run_results.prompt_tokens`, ...). */
  tokens?: { prompt: number; completion: number };
}

/** What a worker commits: a summary job's summary, or a task run's output. */
export type JobResult = SummaryResult | TaskRunResult;

/** The outbox row of a run's notification; none without a target. */
export function runOutboxRow(
  r: { jobId: string; tenant: string; notify?: Notify; traceparent?: string } & jobs.RunOf,
  status: "done" | "failed" | "expired",
  error?: string,
): outbox.NewOutboxRow | undefined {
  if (r.notify === undefined) return undefined;
  const common = { job_id: r.jobId, tenant: r.tenant, task: r.task, version: r.version, status, error };
  const email = typeof r.notify === "string";
  return {
    topic: email ? RUN_EMAIL_TOPIC : RUN_WEBHOOK_TOPIC,
    dedupeKey: RUN_KEY_PREFIX[email ? "email" : "webhook"][status] + r.jobId,
    payload: JSON.stringify(
      typeof r.notify === "string"
        ? { ...common, to: r.notify, traceparent: r.traceparent }
        : { ...common, webhook: r.notify.webhook, traceparent: r.traceparent },
    ),
  };
}

/** The outbox row a result's notification becomes: its topic, dedupe key and payload (a reference to the summary). */
function outboxRowFor(r: JobResult): outbox.NewOutboxRow | undefined {
  if ("task" in r) return runOutboxRow(r, "done");
  if (typeof r.notify === "string") {
    return {
      topic: SUMMARY_READY_TOPIC,
      dedupeKey: SUMMARY_READY_KEY_PREFIX + r.jobId,
      payload: JSON.stringify({ job_id: r.jobId, tenant: r.tenant, to: r.notify, traceparent: r.traceparent }),
    };
  }
  return {
    topic: SUMMARY_WEBHOOK_TOPIC,
    dedupeKey: SUMMARY_WEBHOOK_KEY_PREFIX + r.jobId,
    payload: JSON.stringify({
      job_id: r.jobId,
      tenant: r.tenant,
      webhook: r.notify.webhook,
      traceparent: r.traceparent,
    }),
  };
}

/**
 * Commits summaries and their outbox rows in one statement (one round trip,
 * one transaction). The job store's {@linkcode jobs.completeJobs} is the
 * exactly-once guard: it decides done, and stores summaries for, only jobs
 * nobody decided before; outbox rows are written for exactly those, in the
 * same statement. When two deliveries race, both paid for the model, but one
 * writes. When a cancel races the commit, `job_outcomes`' primary key
 * decides, so a job is either done with its effects or cancelled with none.
 * @returns the job ids this call committed; the others were already done, or cancelled.
 */
export async function commitResults(sql: Sql, results: JobResult[]): Promise<Set<string>> {
  if (results.length === 0) return new Set();
  // The outbox row references the result (by job id) instead of holding a second copy of it.
  const rows = results.flatMap((r) => {
    const row = outboxRowFor(r);
    return row ? [{ ...row, jobId: r.jobId }] : [];
  });
  // A cached result records what it reused, with it: a hit is counted exactly when its run is done.
  const hits = results.filter((r) => r.cacheHit).map(cacheHitRow);
  return await jobs.completeJobs(
    sql,
    results.map((r) => ("task" in r && r.cacheHit ? { ...r, cached: true } : r)),
    (decided) => [
      ...(rows.length > 0 ? [outbox.insertOutboxRowsOf(sql, rows, decided)] : []),
      ...(hits.length > 0 ? [insertCacheHitsOf(sql, hits, decided)] : []),
    ],
  );
}

/** The `cache_hits` row of a cached result. */
function cacheHitRow(r: JobResult): CacheHitRow {
  const { task, version } = "task" in r ? r : jobs.SUMMARY_RUN;
  return { runId: r.jobId, tenant: r.tenant, task, version, ...r.cacheHit! };
}

/**
 * Decides that a job failed, as {@linkcode jobs.failJob} does, and for a task run with a notification target
 * writes its failure notification in the same transaction (once: the dedupe key is per run).
 * @returns what the job is now (see `failJob`).
 */
export async function failRun(
  sql: Sql,
  run: { jobId: string; tenant: string; notify?: Notify; acceptedMs?: number } & jobs.RunOf,
  reason: string,
  { summary }: { summary: boolean },
): Promise<Outcome> {
  if (summary) return await jobs.failJob(sql, run.jobId, run.tenant, reason, run);
  return await sql.begin(async (tx) => {
    const outcome = await jobs.failJob(tx, run.jobId, run.tenant, reason, run);
    // The notification says what GET says: a stable class, never the provider's or the database's own text.
    const row = outcome === "failed" ? runOutboxRow(run, "failed", publicError(reason)) : undefined;
    if (row) await outbox.insertOutboxRows(tx, [row]);
    return outcome;
  });
}

/**
 * Decides that a run expired (its model call had not started by `expiresAtMs`), as {@linkcode jobs.expireJob}
 * does, and with a notification target writes its `run.expired` notification in the same transaction (once: the
 * dedupe key is per run, and only the call that decides it writes it).
 * @returns what the job is now: "expired", or what it was decided first (done, cancelled, failed).
 */
export async function expireRun(
  sql: Sql,
  run: { jobId: string; tenant: string; notify?: Notify; acceptedMs?: number; traceparent?: string } & jobs.RunOf,
  expiresAtMs: number,
): Promise<Outcome> {
  return await sql.begin(async (tx) => {
    const outcome = await jobs.expireJob(tx, run.jobId, run.tenant, { ...run, expiresAtMs });
    const row = outcome === "expired" ? runOutboxRow(run, "expired") : undefined;
    if (row) await outbox.insertOutboxRows(tx, [row]);
    return outcome;
  });
}

/**
 * Whether a dead letter of `jobId` may run again, and if so, makes it
 * undecided: deletes its 'failed' outcome (a replay is the one step that
 * takes a decision back, and only that kind). A job with any other outcome,
 * a summary or an outbox row has had its effects (or a cancel) already.
 * @returns null when the replay may go ahead, else what the job already is.
 */
export async function reopenFailedJob(
  sql: Sql,
  jobId: string,
): Promise<"done" | "cancelled" | "expired" | null> {
  return await sql.begin(async (tx) => {
    // A run's failure notification does not count: a replayed run may still complete.
    const notified = await outbox.hasRowWithKey(tx, [
      SUMMARY_READY_KEY_PREFIX + jobId,
      SUMMARY_WEBHOOK_KEY_PREFIX + jobId,
      RUN_KEY_PREFIX.email.done + jobId,
      RUN_KEY_PREFIX.webhook.done + jobId,
    ]);
    const already = await jobs.reopenFailedJob(tx, jobId, notified);
    // A run's failure notice that has not gone out yet never will: the replayed run may yet complete. (One
    // that was sent stays sent; a completed replay then sends run.completed after it.)
    if (already === null) {
      await outbox.deleteUnsentRows(tx, [RUN_KEY_PREFIX.email.failed + jobId, RUN_KEY_PREFIX.webhook.failed + jobId]);
    }
    return already;
  });
}

/**
 * What one commit came to: "done" if it committed the job, "duplicate" if the
 * job was already done, "cancelled", "failed" or "expired" if a cancel, a
 * dead letter or its expiry decided it first (nothing was written).
 */
export type Committed = "done" | "duplicate" | "cancelled" | "failed" | "expired";

/** Commits one summary at a time as jobs finish, grouping those that finish together. */
export interface GroupCommitter {
  commit(result: JobResult): Promise<Committed>;
}

/** Defaults of {@linkcode createGroupCommitter}. */
export const COMMIT_DEFAULTS = {
  /**
   * Commits in flight at once (each on its own connection of the pool). Jobs that finish while all are in flight
   * wait for one to end and share the next. A finishing job commits without its slot, so a commit's wait holds
   * no slot: two in flight make larger groups than four, fewer statements per job (each a write to Postgres,
   * charged to the worker's thread on loopback), and less of the worker's CPU per job (see README, "Per-job cost
   * of the worker (issue 26)").
   */
  inFlight: 2,
} as const;

/**
 * Group commit without added latency: the first job commits at once; jobs
 * that finish while that transaction is in flight are committed together in
 * the next one (up to `maxBatch`). Each job keeps its own exactly-once guard.
 * If a batch fails, its jobs fall back to one transaction each, so one bad
 * row fails only its own job.
 */
export function createGroupCommitter(
  { sql, log }: { sql: Sql; log: Logger },
  options: { maxBatch?: number; inFlight?: number } = {},
): GroupCommitter {
  type Result = Committed | { error: unknown };
  const lostTo = (outcome: Outcome | undefined): Committed =>
    outcome === "cancelled" || outcome === "failed" || outcome === "expired" ? outcome : "duplicate";
  const commitOne = async (r: JobResult): Promise<Result> => {
    try {
      if ((await commitResults(sql, [r])).has(r.jobId)) return "done";
      return lostTo((await jobs.outcomesOf(sql, [r.jobId])).get(r.jobId));
    } catch (error) {
      return { error };
    }
  };
  const commit = createBatcher<JobResult, Result>(async (results) => {
    // Two deliveries of one job in the same batch: the first decides, the others are duplicates.
    const firstIndex = new Map<string, number>();
    results.forEach((r, i) => firstIndex.has(r.jobId) || firstIndex.set(r.jobId, i));
    const unique = [...firstIndex.values()].map((i) => results[i]!);
    let outcomes: Map<string, Result>;
    try {
      const inserted = await commitResults(sql, unique);
      const lost = unique.filter((r) => !inserted.has(r.jobId)).map((r) => r.jobId);
      // Rare: a redelivery of a committed job, or a cancel or dead letter that won. job_outcomes says which.
      const decided = lost.length > 0 ? await jobs.outcomesOf(sql, lost) : new Map<string, Outcome>();
      outcomes = new Map(unique.map((r) => [r.jobId, inserted.has(r.jobId) ? "done" : lostTo(decided.get(r.jobId))]));
    } catch (error) {
      if (unique.length > 1) log.warn("group_commit_failed", { jobs: unique.length, error });
      const each = unique.length > 1 ? await Promise.all(unique.map(commitOne)) : [{ error }];
      outcomes = new Map(unique.map((r, i) => [r.jobId, each[i]!]));
    }
    return results.map((r, i) => {
      const outcome = outcomes.get(r.jobId)!;
      return firstIndex.get(r.jobId) === i || typeof outcome === "object" ? outcome : "duplicate";
    });
  }, { maxBatch: options.maxBatch ?? 500, maxInFlight: options.inFlight ?? COMMIT_DEFAULTS.inFlight });
  return {
    async commit(result) {
      const outcome = await commit(result);
      if (typeof outcome === "object") throw outcome.error;
      return outcome;
    },
  };
}

/**
 * Whether jobs are already decided (done or cancelled), with concurrent
 * checks coalesced into one `= ANY(...)` query, so a wave of new deliveries
 * costs one round trip. (The migration that made job_outcomes gave every
 * job already done its row.)
 */
export function createDecidedCheck(sql: Sql): (jobId: string) => Promise<Outcome | undefined> {
  return createBatcher<string, Outcome | undefined>(async (ids) => {
    const found = await jobs.outcomesOf(sql, ids);
    return ids.map((id) => found.get(id));
    // One in flight: the checks asked during a round trip share the next (larger batches, fewer statements);
    // a job that starts waits at most one more round trip for its own. With the commits' two in flight, the worker
    // spent less CPU per job at 200 ms (measured against the SDK alone in the README, "Per-job cost of the worker
    // (issue 26)").
  }, { maxBatch: 1000, maxInFlight: 1 });
}
