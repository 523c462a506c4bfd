/**
 * The job read model: a job's document as `GET /v1/summaries/{id}` shows it,
 * from its outcome, summary and model attempts in Postgres and its status
 * record in Redis.
 */
import type { Sql } from "postgres";
import type { RedisClient } from "../clients.ts";
import { readJob, SUMMARY_RUN } from "../jobs/job_store.ts";
import { readJobRecord } from "./job_status.ts";
import type { ServiceKeys } from "./keys.ts";
import { publicError } from "./public_error.ts";
import { JOB_ID, type SummaryStatus } from "./shapes.ts";

/** A job as the API finds it: its document, where its Redis record is, and its tokens by kind. */
export interface JobFound {
  document: SummaryStatus;
  recordKey?: string;
  /** Prompt and completion tokens of its recorded model calls (or, until they are written, its commit's). */
  tokens: { prompt: number; completion: number };
  /** Whether `tokens` are known: its attempts are recorded, or its commit kept them. */
  tokensKnown: boolean;
  /** What it runs: summarize v1 for a summary job; a done task run's output and model. */
  run: { task: string; version: number; summaryJob: boolean; output?: unknown; model?: string };
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
  const cost = decided.cost_usd === null ? {} : { cost_usd: decided.cost_usd };
  const usage = decided.attempts > 0 ? { attempts: decided.attempts, tokens: decided.tokens ?? 0, ...cost } : {};
  // Its recorded attempts' tokens; until they are written (in batches, after the commit), a done run's as its
  // commit kept them.
  const committedTokens = decided.attempts === 0 && decided.result_prompt_tokens !== null;
  const tokens = committedTokens
    ? { prompt: decided.result_prompt_tokens ?? 0, completion: decided.result_completion_tokens ?? 0 }
    : { prompt: decided.prompt_tokens ?? 0, completion: decided.completion_tokens ?? 0 };
  const tokensKnown = committedTokens || decided.attempts > 0;
  // Another tenant's job is indistinguishable from an unknown one.
  if (decided.outcome) {
    if (decided.tenant !== tenant) return null;
    const run = {
      task: decided.task ?? SUMMARY_RUN.task,
      version: decided.version ?? SUMMARY_RUN.version,
      summaryJob: !decided.has_result && (found ? found.record.task === undefined : decided.task === SUMMARY_RUN.task),
    };
    if (decided.outcome === "cancelled" || decided.outcome === "failed" || decided.outcome === "expired") {
      const document: SummaryStatus = { job_id: jobId, status: decided.outcome, ...usage };
      if (decided.outcome === "failed") document.error = publicError(decided.error ?? found?.record.error ?? "");
      return { document, recordKey: found?.key, tokens, tokensKnown, run };
    }
    // A run answered from the result cache says so (it made no model call, so it has no attempts or tokens).
    const cached = decided.cached ? { cached: true as const } : {};
    if (decided.has_result) {
      const result = { output: decided.output, ...(decided.model === null ? {} : { model: decided.model }) };
      return {
        document: { job_id: jobId, status: "done", ...usage, ...cached },
        tokens,
        tokensKnown,
        run: { ...run, ...result },
      };
    }
    // Done, but its summary is past SUMMARY_RETENTION_S: as if unknown.
    if (decided.summary === null) return null;
    return {
      document: { job_id: jobId, status: "done", summary: decided.summary, ...usage, ...cached },
      tokens,
      tokensKnown,
      run,
    };
  }
  if (!found) return null;
  const { record, key: recordKey } = found;
  const status = record.status === "failed" || record.status === "cancelled" ? record.status : "queued";
  const document: SummaryStatus = { job_id: jobId, status, ...usage };
  if (status === "failed") document.error = publicError(record.error ?? "");
  const run = record.task === undefined
    ? { ...SUMMARY_RUN, summaryJob: true }
    : { task: record.task, version: Number(record.version), summaryJob: false };
  return { document, recordKey, tokens, tokensKnown, run };
}
