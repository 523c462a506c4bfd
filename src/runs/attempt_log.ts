/**
 * The record of every model attempt (`model_attempts`). Attempts are
 * buffered and inserted in batches, one statement per batch, never inside a
 * job's commit: a slow or failing insert delays no job. A batch that cannot
 * be written is logged and dropped, since the record is for operators and
 * billing estimates, not for correctness; but a batch refused for the values
 * of its rows is written in halves until only the bad rows are dropped (the
 * rows of a batch are many tenants' calls).
 */
import type { Sql } from "postgres";
import { type AttemptRow, failedAttemptsOf, insertAttempts } from "../jobs/job_store.ts";
import type { Logger } from "../log/logger.ts";
import type { AttemptDetails, AttemptReport } from "../retry/retry_policy.ts";
import { type CallTokens, chargeNanos } from "../budgets/charge.ts";
import type { ModelPrice } from "../llm/prices.ts";

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
    charged_tokens?: number | null;
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

/**
 * The tokens an attempt is charged against its tenant's budgets, by the same basis as {@linkcode attemptCost}: the
 * reported usage, the reservation, or nothing.
 */
export function attemptCharge(details: AttemptDetails | undefined, reserved: CallTokens): number {
  const basis = details?.charge ?? "none";
  if (basis === "reported") return (details?.prompt_tokens ?? 0) + (details?.completion_tokens ?? 0);
  return basis === "reserved" ? reserved.prompt + reserved.completion : 0;
}

/** Whole nano-dollars as an exact decimal of USD (`1234` is "0.000001234"), for a `numeric` column. */
function decimalUsd(nanos: number): string {
  const digits = String(nanos).padStart(10, "0");
  return `${digits.slice(0, -9)}.${digits.slice(-9)}`;
}

/** SQLSTATE class 22, "data exception": a value the column cannot take (out of range, bad syntax, a NUL). */
const DATA_EXCEPTION_CLASS = "22";
/** SQLSTATE class 23, "integrity constraint violation": a NULL in a NOT NULL column, say. */
const INTEGRITY_CONSTRAINT_VIOLATION_CLASS = "23";

/**
 * Whether an insert failed for the values of its rows, so that the same rows fail the same way and others
 * would not: Postgres refused one (SQLSTATE class 22 or 23), or one could not be sent at all (the driver's or
 * our own `TypeError` or `RangeError`, such as an invalid date).
 */
function refusedForValues(error: unknown): boolean {
  if (error instanceof TypeError || error instanceof RangeError) return true;
  const code = (error as { code?: unknown })?.code;
  return typeof code === "string" && code.length === 5 &&
    (code.startsWith(DATA_EXCEPTION_CLASS) || code.startsWith(INTEGRITY_CONSTRAINT_VIOLATION_CLASS));
}

/** Starts a log that flushes every `everyMs` or at `maxBatch` rows, whichever comes first. */
export function createAttemptLog(
  { sql, log }: { sql: Sql; log: Logger },
  { everyMs = 200, maxBatch = 500 }: { everyMs?: number; maxBatch?: number } = {},
): AttemptLog {
  let buffer: AttemptRow[] = [];
  let writing: Promise<void> = Promise.resolve();
  const write = async (rows: AttemptRow[]): Promise<void> => {
    try {
      await insertAttempts(sql, rows);
    } catch (error) {
      // One bad row MUST NOT cost the others: halve until the statement that fails holds that row alone. A
      // failure that is not about the values (Postgres down) would fail every half too: the batch is dropped.
      if (refusedForValues(error) && rows.length > 1) {
        const half = Math.ceil(rows.length / 2);
        await write(rows.slice(0, half));
        await write(rows.slice(half));
      } else if (refusedForValues(error)) {
        const [{ job_id, tenant, delivery, attempt }] = rows as [AttemptRow];
        log.warn("model_attempt_dropped", { job_id, tenant, delivery, attempt, error });
      } else {
        log.warn("model_attempts_write_failed", { rows: rows.length, error });
      }
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
