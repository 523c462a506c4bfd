/**
 * The job read model: a job's document as `GET /v1/summaries/{id}` shows it,
 * from its outcome, summary and model attempts in Postgres and its status
 * record in Redis.
 */
import type { Sql } from "postgres";
import type { RedisClient } from "../clients.ts";
import type { Outcome } from "./commit.ts";
import type { ServiceKeys } from "./keys.ts";
import { publicError } from "./public_error.ts";
import { JOB_ID, type SummaryStatus } from "./schemas.ts";

/** A job's document as GET shows it, and where its Redis record is; null for an unknown or another tenant's job. */
export async function jobDocument(
  { redis, sql, keys }: { redis: RedisClient; sql: Sql; keys: ServiceKeys },
  tenant: string,
  jobId: string,
): Promise<{ document: SummaryStatus; recordKey?: string } | null> {
  if (!JOB_ID.test(jobId)) return null;
  const laneKey = keys.lane(tenant).job(jobId);
  type Row = {
    tenant: string | null;
    outcome: Outcome | null;
    error: string | null;
    summary: string | null;
    attempts: number;
    tokens: number | null;
  };
  const [rows, laneRecord] = await Promise.all([
    // The outcome, the summary, and the totals of the job's model attempts (those of this tenant only).
    sql<Row[]>`
        SELECT coalesce(o.tenant, s.tenant) AS tenant, coalesce(o.outcome, CASE WHEN s.job_id IS NOT NULL THEN 'done' END)
            AS outcome, o.error, s.summary, a.attempts, a.tokens
        FROM (SELECT ${jobId}::uuid AS job_id) j
        LEFT JOIN job_outcomes o USING (job_id) LEFT JOIN summaries s USING (job_id)
        CROSS JOIN LATERAL (
          SELECT count(*)::int AS attempts,
            (sum(coalesce(prompt_tokens, 0) + coalesce(completion_tokens, 0)))::int AS tokens
          FROM model_attempts m WHERE m.job_id = j.job_id AND m.tenant = ${tenant}
        ) a`,
    redis.hgetall(laneKey),
  ]);
  const decided = rows[0]!;
  const usage = decided.attempts > 0 ? { attempts: decided.attempts, tokens: decided.tokens ?? 0 } : {};
  // Another tenant's job is indistinguishable from an unknown one.
  if (decided.outcome) {
    if (decided.tenant !== tenant) return null;
    if (decided.outcome === "cancelled" || decided.outcome === "failed") {
      const document: SummaryStatus = { job_id: jobId, status: decided.outcome, ...usage };
      if (decided.outcome === "failed") document.error = publicError(decided.error ?? laneRecord.error ?? "");
      return { document, recordKey: laneRecord.tenant ? laneKey : undefined };
    }
    // Done, but its summary is past SUMMARY_RETENTION_S: as if unknown.
    if (decided.summary === null) return null;
    return { document: { job_id: jobId, status: "done", summary: decided.summary, ...usage } };
  }
  // A job queued before lanes has its record beside the old single stream.
  const [record, recordKey] = laneRecord.tenant
    ? [laneRecord, laneKey]
    : [await redis.hgetall(keys.legacy.job(jobId)), keys.legacy.job(jobId)];
  if (record.tenant !== tenant) return null;
  const status = record.status === "failed" || record.status === "cancelled" ? record.status : "queued";
  const document: SummaryStatus = { job_id: jobId, status, ...usage };
  if (status === "failed") document.error = publicError(record.error ?? "");
  return { document, recordKey };
}
