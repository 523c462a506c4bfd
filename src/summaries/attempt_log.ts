/**
 * The record of every model attempt (`model_attempts`). Attempts are
 * buffered and inserted in batches, one statement per batch, never inside a
 * job's commit: a slow or failing insert delays no job. A batch that cannot
 * be written is logged and dropped, since the record is for operators and
 * billing estimates, not for correctness.
 */
import type { Sql } from "postgres";
import { type AttemptRow, failedAttemptsOf, insertAttempts } from "../jobs/job_store.ts";
import type { Logger } from "../log/logger.ts";
import type { AttemptDetails, AttemptReport } from "../retry/retry_policy.ts";
import { type CallTokens, chargeNanos } from "../budgets/charge.ts";
import type { ModelPrice } from "../provider/prices.ts";

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
  job: {
    job_id: string;
    tenant: string;
    delivery: number;
    model: string;
    task: string;
    version: number;
    deployment: string;
    cost_usd: string | null;
  },
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

/**
 * What an attempt is charged, in USD as an exact decimal string, at `price` (null without one): its
 * {@linkcode AttemptDetails.charge} basis (`chargeOf`'s rule) read as the reported usage, the reservation, or
 * nothing. A call that may have run without reporting usage costs its reservation, never zero.
 */
export function attemptCost(
  details: AttemptDetails | undefined,
  reserved: CallTokens,
  price: ModelPrice | undefined,
): string | null {
  if (price === undefined) return null;
  const basis = details?.charge ?? "none";
  const tokens = basis === "reported"
    ? { prompt: details?.prompt_tokens ?? 0, completion: details?.completion_tokens ?? 0 }
    : basis === "reserved"
    ? reserved
    : { prompt: 0, completion: 0 };
  return decimalUsd(chargeNanos(tokens, price)!);
}

/** Whole nano-dollars as an exact decimal of USD (`1234` is "0.000001234"), for a `numeric` column. */
function decimalUsd(nanos: number): string {
  const digits = String(nanos).padStart(10, "0");
  return `${digits.slice(0, -9)}.${digits.slice(-9)}`;
}

/** Starts a log that flushes every `everyMs` or at `maxBatch` rows, whichever comes first. */
export function createAttemptLog(
  { sql, log }: { sql: Sql; log: Logger },
  { everyMs = 200, maxBatch = 500 }: { everyMs?: number; maxBatch?: number } = {},
): AttemptLog {
  let buffer: AttemptRow[] = [];
  let writing: Promise<void> = Promise.resolve();
  const write = async (rows: AttemptRow[]) => {
    try {
      await insertAttempts(sql, rows);
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
  const row = await failedAttemptsOf(sql, jobId);
  if (!row || row.failed === 0) return null;
  const calls = `${row.failed} model call${row.failed === 1 ? "" : "s"} failed (${row.how})`;
  return row.others_ok ? `${calls}, while the provider served other jobs` : calls;
}
