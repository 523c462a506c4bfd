/**
 * The record of every model attempt (`model_attempts`). Attempts are
 * buffered and inserted in batches, one statement per batch, never inside a
 * job's commit: a slow or failing insert delays no job. A batch that cannot
 * be written is logged and dropped, since the record is for operators and
 * billing estimates, not for correctness.
 */
import type { Sql } from "postgres";
import type { Logger } from "../log/logger.ts";
import type { AttemptReport } from "../retry/retry_policy.ts";

/** One model call as recorded. */
export interface AttemptRow {
  job_id: string;
  tenant: string;
  delivery: number;
  attempt: number;
  started_at: Date;
  duration_ms: number;
  outcome: string;
  status: number | null;
  prompt_tokens: number | null;
  completion_tokens: number | null;
  provider_request_id: string | null;
  model: string;
  error: string | null;
}

/** Buffers attempts and writes them in batches. */
export interface AttemptLog {
  record(row: AttemptRow): void;
  /** Writes what is buffered now. */
  flush(): Promise<void>;
  /** Flushes and stops the timer. */
  close(): Promise<void>;
}

/** The row for a report of `callWithRetries`; null for an attempt that never started (a spent budget). */
export function attemptRow(
  report: AttemptReport,
  job: { job_id: string; tenant: string; delivery: number; model: string },
): AttemptRow | null {
  if (report.started_at_ms === undefined) return null;
  const d = report.details ?? {};
  return {
    ...job,
    attempt: report.attempt,
    started_at: new Date(report.started_at_ms),
    duration_ms: report.duration_ms,
    outcome: report.outcome,
    status: report.status ?? null,
    prompt_tokens: d.prompt_tokens ?? null,
    completion_tokens: d.completion_tokens ?? null,
    provider_request_id: d.request_id ?? null,
    // The model asked for, not the dated snapshot a provider answers with: one row per model in reports.
    model: job.model,
    error: report.outcome === "ok" ? null : (d.error_class ?? report.reason ?? "unknown"),
  };
}

/** Starts a log that flushes every `everyMs` or at `maxBatch` rows, whichever comes first. */
export function createAttemptLog(
  { sql, log }: { sql: Sql; log: Logger },
  { everyMs = 200, maxBatch = 500 }: { everyMs?: number; maxBatch?: number } = {},
): AttemptLog {
  let buffer: AttemptRow[] = [];
  let writing: Promise<void> = Promise.resolve();
  const write = async (rows: AttemptRow[]) => {
    const col = <K extends keyof AttemptRow>(k: K) => rows.map((r) => r[k]);
    try {
      await sql`
        INSERT INTO model_attempts (job_id, tenant, delivery, attempt, started_at, duration_ms, outcome, status,
          prompt_tokens, completion_tokens, provider_request_id, model, error)
        SELECT * FROM unnest(
          ${col("job_id")}::uuid[], ${col("tenant")}::text[], ${col("delivery")}::int[], ${col("attempt")}::int[],
          ${col("started_at").map((d) => d.toISOString())}::timestamptz[], ${col("duration_ms")}::float8[],
          ${col("outcome")}::text[], ${col("status") as (number | null)[]}::int[],
          ${col("prompt_tokens") as (number | null)[]}::int[], ${col("completion_tokens") as (number | null)[]}::int[],
          ${col("provider_request_id") as (string | null)[]}::text[], ${col("model")}::text[],
          ${col("error") as (string | null)[]}::text[]
        )`;
    } catch (error) {
      log.warn("model_attempts_write_failed", { rows: rows.length, error });
    }
  };
  const flush = () => {
    if (buffer.length === 0) return writing;
    const rows = buffer;
    buffer = [];
    // One batch at a time, in order.
    writing = writing.then(() => write(rows));
    return writing;
  };
  const timer = setInterval(() => void flush(), everyMs);
  Deno.unrefTimer(timer);
  return {
    record(row) {
      buffer.push(row);
      if (buffer.length >= maxBatch) void flush();
    },
    flush,
    async close() {
      clearInterval(timer);
      await flush();
    },
  };
}

/**
 * What a job's recorded attempts say about its failure, for a dead letter's
 * reason: how many calls failed and how, and whether the provider served
 * other jobs meanwhile (then the failure is the job's own, a poison
 * document). Null when nothing was recorded.
 */
export async function describeFailures(sql: Sql, jobId: string): Promise<string | null> {
  const [row] = await sql<{ failed: number; how: string | null; others_ok: boolean }[]>`
    WITH mine AS (SELECT * FROM model_attempts WHERE job_id = ${jobId}::uuid AND outcome <> 'ok')
    SELECT (SELECT count(*) FROM mine)::int AS failed,
      (SELECT string_agg(label || ' ×' || n, ', ' ORDER BY n DESC) FROM (
        SELECT coalesce('http_' || status, error, 'unknown') AS label, count(*) AS n FROM mine GROUP BY 1
      ) k) AS how,
      EXISTS (
        SELECT 1 FROM model_attempts o
        WHERE o.outcome = 'ok' AND o.job_id <> ${jobId}::uuid
          AND o.started_at BETWEEN (SELECT min(started_at) FROM mine) AND (SELECT max(started_at) FROM mine)
      ) AS others_ok`;
  if (!row || row.failed === 0) return null;
  const calls = `${row.failed} model call${row.failed === 1 ? "" : "s"} failed (${row.how})`;
  return row.others_ok ? `${calls}, while the provider served other jobs` : calls;
}
