/**
 * The job read model: a job's document as `GET /v1/summaries/{id}` shows it,
 * from its outcome, summary and model attempts in Postgres and its status
 * record in Redis.
 */
import type { Sql } from "postgres";
import type { RedisClient } from "../clients.ts";
import { readJob } from "../jobs/job_store.ts";
import { readJobRecord } from "./job_status.ts";
import type { ServiceKeys } from "./keys.ts";
import { publicError } from "./public_error.ts";
import { JOB_ID, type SummaryStatus } from "./schemas.ts";

/** A job as the API finds it: its document, where its Redis record is, and its tokens by kind. */
export interface JobFound {
  document: SummaryStatus;
  recordKey?: string;
  /** Prompt and completion tokens of its recorded model calls. */
  tokens: { prompt: number; completion: number };
}

/** A job's document as GET shows it, and where its Redis record is; null for an unknown or another tenant's job. */
export async function jobDocument(
  { redis, sql, keys }: { redis: RedisClient; sql: Sql; keys: ServiceKeys },
  tenant: string,
  jobId: string,
): Promise<JobFound | null> {
  if (!JOB_ID.test(jobId)) return null;
  const [decided, found] = await Promise.all([
    // The outcome, the summary, and the totals of the job's model attempts (those of this tenant only).
    readJob(sql, jobId, tenant),
    readJobRecord(redis, keys, jobId, tenant),
  ]);
  const usage = decided.attempts > 0 ? { attempts: decided.attempts, tokens: decided.tokens ?? 0 } : {};
  const tokens = { prompt: decided.prompt_tokens ?? 0, completion: decided.completion_tokens ?? 0 };
  // Another tenant's job is indistinguishable from an unknown one.
  if (decided.outcome) {
    if (decided.tenant !== tenant) return null;
    if (decided.outcome === "cancelled" || decided.outcome === "failed") {
      const document: SummaryStatus = { job_id: jobId, status: decided.outcome, ...usage };
      if (decided.outcome === "failed") document.error = publicError(decided.error ?? found?.record.error ?? "");
      return { document, recordKey: found?.key, tokens };
    }
    // Done, but its summary is past SUMMARY_RETENTION_S: as if unknown.
    if (decided.summary === null) return null;
    return { document: { job_id: jobId, status: "done", summary: decided.summary, ...usage }, tokens };
  }
  if (!found) return null;
  const { record, key: recordKey } = found;
  const status = record.status === "failed" || record.status === "cancelled" ? record.status : "queued";
  const document: SummaryStatus = { job_id: jobId, status, ...usage };
  if (status === "failed") document.error = publicError(record.error ?? "");
  return { document, recordKey, tokens };
}
