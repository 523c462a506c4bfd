/**
 * Rows of finished runs and model calls, written straight into the test
 * database as the worker writes them (task and version on `model_attempts`
 * and `job_outcomes`, a done task run's `run_results` row), for the tests of
 * what reads them: `deno task usage` and the console.
 */
import type { Sql } from "postgres";

/** One model call of a run; unset fields are a quick successful call of `summarize` v1. */
export interface AttemptRowSpec {
  runId: string;
  tenant: string;
  task?: string;
  version?: number;
  model?: string;
  outcome?: string;
  status?: number | null;
  promptTokens?: number | null;
  completionTokens?: number | null;
  durationMs?: number;
  startedAt?: Date;
  delivery?: number;
  attempt?: number;
  error?: string | null;
  /** What the call was charged, an exact decimal of USD (NULL when unset: no price). */
  costUsd?: string | null;
}

/** Inserts one `model_attempts` row. */
export async function recordAttempt(sql: Sql, a: AttemptRowSpec): Promise<void> {
  await sql`
    INSERT INTO model_attempts (job_id, tenant, task, version, delivery, attempt, started_at, duration_ms, outcome,
      status, prompt_tokens, completion_tokens, provider_request_id, model, error, cost_usd, deployment)
    VALUES (${a.runId}, ${a.tenant}, ${a.task ?? "summarize"}, ${a.version ?? 1}, ${a.delivery ?? 1},
      ${a.attempt ?? 1}, ${a.startedAt ?? new Date()}, ${a.durationMs ?? 100}, ${a.outcome ?? "ok"},
      ${a.status === undefined ? 200 : a.status}, ${a.promptTokens ?? null}, ${a.completionTokens ?? null},
      ${`req_${crypto.randomUUID()}`}, ${a.model ?? "gpt-test"}, ${a.error ?? null}, ${a.costUsd ?? null}::numeric,
      ${a.model ?? "gpt-test"})`;
}

/** A run answered from the result cache: its `cache_hits` row, with what it saved. */
export interface CacheHitSpec {
  runId: string;
  tenant: string;
  task?: string;
  version?: number;
  model?: string | null;
  sourceRunId?: string;
  savedPromptTokens?: number;
  savedCompletionTokens?: number;
  /** An exact decimal of USD; NULL when unset (the source had no price). */
  savedUsd?: string | null;
  createdAt?: Date;
}

/** Inserts one `cache_hits` row. */
export async function recordCacheHit(sql: Sql, h: CacheHitSpec): Promise<void> {
  await sql`
    INSERT INTO cache_hits (run_id, tenant, task, version, model, source_run_id, saved_prompt_tokens,
      saved_completion_tokens, saved_usd, created_at)
    VALUES (${h.runId}, ${h.tenant}, ${h.task ?? "summarize"}, ${h.version ?? 1},
      ${h.model === undefined ? "gpt-test" : h.model}, ${h.sourceRunId ?? crypto.randomUUID()},
      ${h.savedPromptTokens ?? 0}, ${h.savedCompletionTokens ?? 0}, ${h.savedUsd ?? null}::numeric,
      ${h.createdAt ?? new Date()})`;
}

/** A finished run: its outcome, and for a done task run its input and output. */
export interface RunRowSpec {
  runId: string;
  tenant: string;
  task: string;
  version: number;
  outcome: "done" | "cancelled" | "failed";
  error?: string;
  /** A done run's result (`run_results`); leave it out for a summary, whose result is its `summaries` row. */
  result?: { input: unknown; output: unknown; model: string; cached?: boolean };
}

/** Inserts a run's `job_outcomes` row and, with `result`, its `run_results` row. */
export async function recordRun(sql: Sql, run: RunRowSpec): Promise<void> {
  await sql`
    INSERT INTO job_outcomes (job_id, tenant, task, version, outcome, error)
    VALUES (${run.runId}, ${run.tenant}, ${run.task}, ${run.version}, ${run.outcome}, ${run.error ?? null})`;
  if (!run.result) return;
  const { input, output, model, cached = false } = run.result;
  await sql`
    INSERT INTO run_results (run_id, tenant, input, output, model, cached)
    VALUES (${run.runId}, ${run.tenant}, ${sql.json(input as never)}, ${sql.json(output as never)}, ${model},
      ${cached})`;
}
