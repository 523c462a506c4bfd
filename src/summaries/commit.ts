import type { Sql } from "postgres";
import { createBatcher } from "../async/batcher.ts";
import type { Logger } from "../log/logger.ts";

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
}

/** The outbox topic of a summary's notification email. */
export const SUMMARY_READY_TOPIC = "email.summary_ready";
/** Its dedupe key is this prefix plus the job id; the relay passes it to the provider as Idempotency-Key. */
export const SUMMARY_READY_KEY_PREFIX = "summary_ready:";
/** The outbox topic of a summary's webhook. */
export const SUMMARY_WEBHOOK_TOPIC = "webhook.summary_ready";
/** Its dedupe key is this prefix plus the job id, sent as `webhook-id` so a receiver can deduplicate. */
export const SUMMARY_WEBHOOK_KEY_PREFIX = "summary_webhook:";

/** The outbox row a result's notification becomes: its topic, dedupe key and payload (a reference to the summary). */
function outboxRowFor(r: SummaryResult): { topic: string; dedupeKey: string; payload: string } {
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
 * Commits summaries and their outbox rows in one statement (so one
 * transaction). The job's outcome row is the exactly-once guard: `INSERT
 * INTO job_outcomes ... 'done' ON CONFLICT (job_id) DO NOTHING RETURNING`
 * returns only jobs nobody decided before, and summaries and outbox rows are
 * written for exactly those. When two deliveries race, both paid for the
 * model, but one writes. When a cancel races the commit, the same primary key
 * decides: the second INSERT waits for the first transaction and then
 * conflicts, so a job is either done with its effects or cancelled with none.
 * @returns the job ids this call committed; the others were already done, or cancelled.
 */
export async function commitSummaries(sql: Sql, results: SummaryResult[]): Promise<Set<string>> {
  if (results.length === 0) return new Set();
  // The outbox row references the summary (by job id) instead of holding a second copy of it.
  const outbox = results.map(outboxRowFor);
  const rows = await sql<{ job_id: string }[]>`
    WITH input AS (
      SELECT * FROM unnest(
        ${results.map((r) => r.jobId)}::uuid[],
        ${results.map((r) => r.tenant)}::text[],
        ${results.map((r) => r.summary)}::text[],
        ${outbox.map((o) => o.topic)}::text[],
        ${outbox.map((o) => o.dedupeKey)}::text[],
        ${outbox.map((o) => o.payload)}::text[]
      ) AS t(job_id, tenant, summary, topic, dedupe_key, payload)
    ), decided AS (
      INSERT INTO job_outcomes (job_id, tenant, outcome)
      SELECT job_id, tenant, 'done' FROM input
      ON CONFLICT (job_id) DO NOTHING
      RETURNING job_id
    ), inserted AS (
      -- A worker of the release before job_outcomes may have committed it meanwhile: the conflict catches that.
      INSERT INTO summaries (job_id, tenant, summary)
      SELECT job_id, tenant, summary FROM input JOIN decided USING (job_id)
      ON CONFLICT (job_id) DO NOTHING
      RETURNING job_id
    ), outbox_rows AS (
      INSERT INTO outbox (topic, dedupe_key, payload)
      SELECT input.topic, input.dedupe_key, input.payload::jsonb
      FROM input JOIN inserted USING (job_id)
      ON CONFLICT (dedupe_key) DO NOTHING
    )
    SELECT job_id::text FROM inserted`;
  return new Set(rows.map((r) => r.job_id));
}

/** How a job ended: its row in `job_outcomes`, decided once. */
export type Outcome = "done" | "cancelled" | "failed";

/**
 * The outcomes decided for `jobIds` (a new statement, so it sees outcomes
 * committed while an earlier statement waited). Jobs with no row are absent.
 */
export async function jobOutcomes(sql: Sql, jobIds: string[]): Promise<Map<string, Outcome>> {
  const rows = await sql<{ job_id: string; outcome: Outcome }[]>`
    SELECT job_id::text, outcome FROM job_outcomes WHERE job_id = ANY(${jobIds}::uuid[])`;
  return new Map(rows.map((r) => [r.job_id, r.outcome]));
}

/** What cancelling a job came to. */
export type CancelOutcome = "cancelled" | "already_cancelled" | "done" | "failed";

/**
 * Cancels a job unless it is done, in one statement that races the commit
 * on `job_outcomes`' primary key: exactly one of them wins. A summary
 * without an outcome (committed by a worker of the previous release during
 * an upgrade) also counts as done.
 */
export async function cancelJob(sql: Sql, jobId: string, tenant: string): Promise<CancelOutcome> {
  const inserted = await sql`
    INSERT INTO job_outcomes (job_id, tenant, outcome)
    SELECT ${jobId}::uuid, ${tenant}, 'cancelled'
    WHERE NOT EXISTS (SELECT 1 FROM summaries WHERE job_id = ${jobId}::uuid)
    ON CONFLICT (job_id) DO NOTHING
    RETURNING job_id`;
  if (inserted.length > 0) return "cancelled";
  const outcome = (await jobOutcomes(sql, [jobId])).get(jobId);
  return outcome === "cancelled" ? "already_cancelled" : outcome === "failed" ? "failed" : "done";
}

/**
 * Decides that a job failed (it is about to be dead-lettered), unless it is
 * already decided: the same primary key as the commit and a cancel, so a
 * delivery still running elsewhere can no longer commit it.
 * @returns "failed" when the job is (now, or already) failed: dead-letter it;
 * "done" or "cancelled" when it was decided otherwise: acknowledge it instead.
 */
export async function failJob(sql: Sql, jobId: string, tenant: string, error: string): Promise<Outcome> {
  const inserted = await sql`
    INSERT INTO job_outcomes (job_id, tenant, outcome, error)
    SELECT ${jobId}::uuid, ${tenant}, 'failed', ${error.slice(0, 500)}
    WHERE NOT EXISTS (SELECT 1 FROM summaries WHERE job_id = ${jobId}::uuid)
    ON CONFLICT (job_id) DO NOTHING
    RETURNING job_id`;
  if (inserted.length > 0) return "failed";
  const outcome = (await jobOutcomes(sql, [jobId])).get(jobId);
  if (outcome) return outcome;
  // No row, yet the insert wrote none: a summary from before job_outcomes, or a row deleted meanwhile (a
  // replay, retention). Only a summary means done; otherwise decide nothing now and let a later delivery look.
  const [summary] = await sql`SELECT 1 FROM summaries WHERE job_id = ${jobId}::uuid`;
  if (summary) return "done";
  throw new Error(`job ${jobId}'s outcome changed while it was being decided failed`);
}

/**
 * Whether a dead letter of `jobId` may run again, and if so, makes it
 * undecided: deletes its 'failed' outcome (a replay is the one step that
 * takes a decision back, and only that kind). A job with any other outcome,
 * a summary or an outbox row has had its effects (or a cancel) already.
 * @returns null when the replay may go ahead, else what the job already is.
 */
export async function reopenFailedJob(sql: Sql, jobId: string): Promise<"done" | "cancelled" | null> {
  const [row] = await sql<{ outcome: Outcome | null; effects: boolean }[]>`
    SELECT (SELECT outcome FROM job_outcomes WHERE job_id = ${jobId}::uuid) AS outcome,
      EXISTS (SELECT 1 FROM summaries WHERE job_id = ${jobId}::uuid)
        OR EXISTS (SELECT 1 FROM outbox WHERE dedupe_key IN (
          ${SUMMARY_READY_KEY_PREFIX + jobId}, ${SUMMARY_WEBHOOK_KEY_PREFIX + jobId})) AS effects`;
  if (row!.outcome === "cancelled") return "cancelled";
  if (row!.outcome === "done" || row!.effects) return "done";
  await sql`DELETE FROM job_outcomes WHERE job_id = ${jobId}::uuid AND outcome = 'failed'`;
  return null;
}

/**
 * What one commit came to: "done" if it committed the job, "duplicate" if the
 * job was already done, "cancelled" or "failed" if a cancel or a dead letter
 * decided it first (nothing was written).
 */
export type Committed = "done" | "duplicate" | "cancelled" | "failed";

/** Commits one summary at a time as jobs finish, grouping those that finish together. */
export interface GroupCommitter {
  commit(result: SummaryResult): Promise<Committed>;
}

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
    outcome === "cancelled" || outcome === "failed" ? outcome : "duplicate";
  const commitOne = async (r: SummaryResult): Promise<Result> => {
    try {
      if ((await commitSummaries(sql, [r])).has(r.jobId)) return "done";
      return lostTo((await jobOutcomes(sql, [r.jobId])).get(r.jobId));
    } catch (error) {
      return { error };
    }
  };
  const commit = createBatcher<SummaryResult, Result>(async (results) => {
    // Two deliveries of one job in the same batch: the first decides, the others are duplicates.
    const firstIndex = new Map<string, number>();
    results.forEach((r, i) => firstIndex.has(r.jobId) || firstIndex.set(r.jobId, i));
    const unique = [...firstIndex.values()].map((i) => results[i]!);
    let outcomes: Map<string, Result>;
    try {
      const inserted = await commitSummaries(sql, unique);
      const lost = unique.filter((r) => !inserted.has(r.jobId)).map((r) => r.jobId);
      // Rare: a redelivery of a committed job, or a cancel or dead letter that won. job_outcomes says which.
      const decided = lost.length > 0 ? await jobOutcomes(sql, lost) : new Map<string, Outcome>();
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
  }, { maxBatch: options.maxBatch ?? 500, maxInFlight: options.inFlight ?? 2 });
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
    const rows = await sql<{ job_id: string; outcome: Outcome }[]>`
      SELECT job_id::text, outcome FROM job_outcomes WHERE job_id = ANY(${ids}::uuid[])`;
    const found = new Map(rows.map((r) => [r.job_id, r.outcome]));
    return ids.map((id) => found.get(id));
  }, { maxBatch: 1000, maxInFlight: 2 });
}
