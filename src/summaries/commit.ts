import type { Sql } from "postgres";
import { createBatcher } from "../async/batcher.ts";
import type { Logger } from "../log/logger.ts";

/** A finished summary ready to commit, with what its notification email needs. */
export interface SummaryResult {
  jobId: string;
  tenant: string;
  summary: string;
  notify: string;
}

/** The outbox topic of a summary's notification. */
export const SUMMARY_READY_TOPIC = "email.summary_ready";
/** Its dedupe key is this prefix plus the job id; the relay passes it to the provider as Idempotency-Key. */
export const SUMMARY_READY_KEY_PREFIX = "summary_ready:";

/**
 * Commits summaries and their outbox rows in one statement (so one
 * transaction). `INSERT ... ON CONFLICT (job_id) DO NOTHING RETURNING job_id`
 * is the exactly-once guard: when two deliveries of a job race, both paid for
 * the model, but only the one whose row was inserted writes an outbox row,
 * because outbox rows are written for exactly the returned ids.
 * @returns the job ids this call inserted; the others were already committed.
 */
export async function commitSummaries(sql: Sql, results: SummaryResult[]): Promise<Set<string>> {
  if (results.length === 0) return new Set();
  // The outbox row references the summary (by job id) instead of holding a second copy of it.
  const payloads = results.map((r) => JSON.stringify({ job_id: r.jobId, tenant: r.tenant, to: r.notify }));
  const rows = await sql<{ job_id: string }[]>`
    WITH input AS (
      SELECT * FROM unnest(
        ${results.map((r) => r.jobId)}::uuid[],
        ${results.map((r) => r.tenant)}::text[],
        ${results.map((r) => r.summary)}::text[],
        ${payloads}::text[]
      ) AS t(job_id, tenant, summary, payload)
    ), inserted AS (
      INSERT INTO summaries (job_id, tenant, summary)
      SELECT job_id, tenant, summary FROM input
      ON CONFLICT (job_id) DO NOTHING
      RETURNING job_id
    ), outbox_rows AS (
      INSERT INTO outbox (topic, dedupe_key, payload)
      SELECT ${SUMMARY_READY_TOPIC}, ${SUMMARY_READY_KEY_PREFIX} || input.job_id, input.payload::jsonb
      FROM input JOIN inserted USING (job_id)
      ON CONFLICT (dedupe_key) DO NOTHING
    )
    SELECT job_id::text FROM inserted`;
  return new Set(rows.map((r) => r.job_id));
}

/** Commits one summary at a time as jobs finish, grouping those that finish together. */
export interface GroupCommitter {
  /** @returns "done" if this call committed the job, "duplicate" if it was already committed. */
  commit(result: SummaryResult): Promise<"done" | "duplicate">;
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
  type Outcome = "done" | "duplicate" | { error: unknown };
  const commitOne = async (r: SummaryResult): Promise<Outcome> => {
    try {
      return (await commitSummaries(sql, [r])).has(r.jobId) ? "done" : "duplicate";
    } catch (error) {
      return { error };
    }
  };
  const commit = createBatcher<SummaryResult, Outcome>(async (results) => {
    // Two deliveries of one job in the same batch: the first decides, the others are duplicates.
    const firstIndex = new Map<string, number>();
    results.forEach((r, i) => firstIndex.has(r.jobId) || firstIndex.set(r.jobId, i));
    const unique = [...firstIndex.values()].map((i) => results[i]!);
    let outcomes: Map<string, Outcome>;
    try {
      const inserted = await commitSummaries(sql, unique);
      outcomes = new Map(unique.map((r) => [r.jobId, inserted.has(r.jobId) ? "done" : "duplicate"]));
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
 * Whether jobs are already committed, with concurrent checks coalesced into
 * one `= ANY(...)` query, so a wave of new deliveries costs one round trip.
 */
export function createCommittedCheck(sql: Sql): (jobId: string) => Promise<boolean> {
  return createBatcher<string, boolean>(async (ids) => {
    const rows = await sql<{ job_id: string }[]>`
      SELECT job_id::text FROM summaries WHERE job_id = ANY(${ids}::uuid[])`;
    const found = new Set(rows.map((r) => r.job_id));
    return ids.map((id) => found.has(id));
  }, { maxBatch: 1000, maxInFlight: 2 });
}
