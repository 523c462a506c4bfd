/**
 * The job store: the one module that reads and writes the job tables,
 * `job_outcomes` (how each job ended, decided once), `summaries` (a done
 * job's result) and `model_attempts` (the record of every model call). One
 * SQL operation per function; each takes the pool or, inside a transaction
 * that spans stores (the summary commit), that transaction.
 */
import { deleteBatch, type ExpiryBatch, type Fragment, olderThan, type Queryable } from "../db/queryable.ts";

/** How a job ended: its row in `job_outcomes`, decided once. */
export type Outcome = "done" | "cancelled" | "failed" | "expired";

/** What cancelling a job came to. */
export type CancelOutcome = "cancelled" | "already_cancelled" | "done" | "failed" | "expired";

/** Which task version a job runs: summary jobs run the built-in `summarize`, version 1. */
export interface RunOf {
  task: string;
  version: number;
}

/** The built-in task every summary job runs (the columns' defaults in `job_outcomes` and `model_attempts`). */
export const SUMMARY_RUN: RunOf = { task: "summarize", version: 1 };

/**
 * A finished job's result, as {@linkcode completeJobs} stores it: a summary job's summary (in `summaries`),
 * or a task run's input, output and model (in `run_results`).
 */
export type JobResultRow =
  & {
    jobId: string;
    tenant: string;
    /** When the job was accepted (its stream entry's time, epoch ms): `job_outcomes.accepted_at`, for latency. */
    acceptedMs?: number;
  }
  & (
    | { summary: string }
    | (RunOf & {
      input: unknown;
      output: unknown;
      model: string | null;
      cached?: boolean;
      /** The tokens of the committing delivery's calls (`run_results.prompt_tokens`, ...); none for a cached one. */
      tokens?: { prompt: number; completion: number };
    })
  );

/** One model call as recorded in `model_attempts`. */
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
  task: string;
  version: number;
  /**
   * What the call was charged, in USD as an exact decimal (nano-dollars): the reported usage at the model's
   * price, or the reservation of a call that may have run without reporting any; null when the model has no price.
   */
  cost_usd: string | null;
  /** The deployment that served the call: its name in `LLM_DEPLOYMENTS`, or the model's name without it. */
  deployment: string;
  /** The tokens charged against the tenant's budgets (reported, or the reservation; see `attemptCharge`). */
  charged_tokens?: number | null;
}

/**
 * Decides jobs done and stores their summaries, in one statement. The
 * outcome row is the exactly-once guard: `INSERT INTO job_outcomes ... 'done'
 * ON CONFLICT (job_id) DO NOTHING RETURNING` returns only jobs nobody decided
 * before, and summaries are written for exactly those. When two deliveries
 * race, both paid for the model, but one writes. When a cancel races the
 * commit, the same primary key decides: the second INSERT waits for the first
 * transaction and then conflicts. The job's other effects (its outbox row) are
 * written by the same statement: `alsoWrite` gets the relation of the job ids
 * it decides done (`job_id uuid`) and returns other stores' statements that
 * write only for those, so a job is either done with all its effects or
 * decided otherwise with none, in one round trip.
 * @returns the job ids this call decided done.
 */
export async function completeJobs(
  sql: Queryable,
  jobs: JobResultRow[],
  alsoWrite: (decided: Fragment) => Fragment[] = () => [],
): Promise<Set<string>> {
  if (jobs.length === 0) return new Set();
  const run = (j: JobResultRow) => ("summary" in j ? null : j);
  // Each other store's statement is one more data-modifying CTE: Postgres runs every one of them to completion.
  const also = alsoWrite(sql`committed`).reduce(
    (query, statement, i) => sql`${query}, ${sql(`also_${i}`)} AS (${statement})`,
    sql``,
  );
  const rows = await sql<{ job_id: string }[]>`
    WITH input AS (
      SELECT * FROM unnest(
        ${jobs.map((j) => j.jobId)}::uuid[],
        ${jobs.map((j) => j.tenant)}::text[],
        ${jobs.map((j) => run(j)?.task ?? SUMMARY_RUN.task)}::text[],
        ${jobs.map((j) => run(j)?.version ?? SUMMARY_RUN.version)}::int[],
        ${jobs.map((j) => ("summary" in j ? j.summary : null))}::text[],
        ${jobs.map((j) => (run(j) ? JSON.stringify(run(j)!.input) : null))}::text[],
        ${jobs.map((j) => (run(j) ? JSON.stringify(run(j)!.output) : null))}::text[],
        ${jobs.map((j) => run(j)?.model ?? null)}::text[],
        ${jobs.map((j) => j.acceptedMs ?? null)}::float8[],
        ${jobs.map((j) => (run(j)?.cached ? "t" : "f"))}::text[]::bool[],
        ${jobs.map((j) => storableCount(run(j)?.tokens?.prompt))}::int[],
        ${jobs.map((j) => storableCount(run(j)?.tokens?.completion))}::int[]
      ) AS t(job_id, tenant, task, version, summary, input, output, model, accepted_ms, cached, prompt_tokens,
        completion_tokens)
    ), decided AS (
      INSERT INTO job_outcomes (job_id, tenant, outcome, task, version, accepted_at)
      SELECT job_id, tenant, 'done', task, version, to_timestamp(accepted_ms / 1000) FROM input
      ON CONFLICT (job_id) DO NOTHING
      RETURNING job_id
    ), summarised AS (
      -- A worker of the release before job_outcomes may have committed it meanwhile: the conflict catches that.
      INSERT INTO summaries (job_id, tenant, summary)
      SELECT job_id, tenant, summary FROM input JOIN decided USING (job_id) WHERE summary IS NOT NULL
      ON CONFLICT (job_id) DO NOTHING
      RETURNING job_id
    ), ran AS (
      INSERT INTO run_results (run_id, tenant, input, output, model, cached, prompt_tokens, completion_tokens)
      SELECT job_id, tenant, input::jsonb, output::jsonb, model, cached, prompt_tokens, completion_tokens
      FROM input JOIN decided USING (job_id)
      WHERE summary IS NULL
      ON CONFLICT (run_id) DO NOTHING
      RETURNING run_id AS job_id
    ), committed AS (
      SELECT job_id FROM summarised UNION ALL SELECT job_id FROM ran
    )${also}
    SELECT job_id::text FROM committed`;
  return new Set(rows.map((r) => r.job_id));
}

/**
 * The outcomes decided for `jobIds` (a new statement, so it sees outcomes
 * committed while an earlier statement waited). Jobs with no row are absent.
 */
export async function outcomesOf(sql: Queryable, jobIds: string[]): Promise<Map<string, Outcome>> {
  const rows = await sql<{ job_id: string; outcome: Outcome }[]>`
    SELECT job_id::text, outcome FROM job_outcomes WHERE job_id = ANY(${jobIds}::uuid[])`;
  return new Map(rows.map((r) => [r.job_id, r.outcome]));
}

/**
 * Cancels a job unless it is done, in one statement that races the commit
 * on `job_outcomes`' primary key: exactly one of them wins. A summary
 * without an outcome (committed by a worker of the previous release during
 * an upgrade) also counts as done.
 */
export async function cancelJob(
  sql: Queryable,
  jobId: string,
  tenant: string,
  { task, version }: RunOf = SUMMARY_RUN,
): Promise<CancelOutcome> {
  const inserted = await sql`
    INSERT INTO job_outcomes (job_id, tenant, outcome, task, version)
    SELECT ${jobId}::uuid, ${tenant}, 'cancelled', ${task}, ${version}
    WHERE NOT EXISTS (SELECT 1 FROM summaries WHERE job_id = ${jobId}::uuid)
    ON CONFLICT (job_id) DO NOTHING
    RETURNING job_id`;
  if (inserted.length > 0) return "cancelled";
  const outcome = (await outcomesOf(sql, [jobId])).get(jobId);
  return outcome === "cancelled"
    ? "already_cancelled"
    : outcome === "failed" || outcome === "expired"
    ? outcome
    : "done";
}

/**
 * Decides that a run expired (its model call had not started by `expiresAtMs`), unless it is already decided:
 * the same primary key as the commit, a cancel and a dead letter, so whichever is decided first stands. A late
 * delivery then finds it expired in its pre-check and makes no call; a cancel after it answers `expired`.
 * @returns "expired" when this call decided it, else what the job already is (a summary without an outcome, from
 * before job_outcomes, counts as done).
 * @throws Error when its outcome row vanished while it was being decided (let a later delivery look again).
 */
export async function expireJob(
  sql: Queryable,
  jobId: string,
  tenant: string,
  { task, version, acceptedMs, expiresAtMs }: RunOf & { acceptedMs?: number; expiresAtMs: number },
): Promise<Outcome> {
  const inserted = await sql`
    INSERT INTO job_outcomes (job_id, tenant, outcome, task, version, accepted_at, expires_at)
    SELECT ${jobId}::uuid, ${tenant}, 'expired', ${task}, ${version},
      to_timestamp(${acceptedMs ?? null}::float8 / 1000), to_timestamp(${expiresAtMs}::float8 / 1000)
    WHERE NOT EXISTS (SELECT 1 FROM summaries WHERE job_id = ${jobId}::uuid)
    ON CONFLICT (job_id) DO NOTHING
    RETURNING job_id`;
  if (inserted.length > 0) return "expired";
  const outcome = (await outcomesOf(sql, [jobId])).get(jobId);
  if (outcome) return outcome;
  const [summary] = await sql`SELECT 1 FROM summaries WHERE job_id = ${jobId}::uuid`;
  if (summary) return "done";
  throw new Error(`job ${jobId}'s outcome changed while it was being decided expired`);
}

/**
 * Decides that a job failed (it is about to be dead-lettered), unless it is
 * already decided: the same primary key as the commit and a cancel, so a
 * delivery still running elsewhere can no longer commit it.
 * @returns "failed" when the job is (now, or already) failed: dead-letter it;
 * "done" or "cancelled" when it was decided otherwise: acknowledge it instead.
 * @throws Error when its outcome row vanished while it was being decided (let a later delivery look again).
 */
export async function failJob(
  sql: Queryable,
  jobId: string,
  tenant: string,
  error: string,
  { task, version, acceptedMs }: RunOf & { acceptedMs?: number } = SUMMARY_RUN,
): Promise<Outcome> {
  const inserted = await sql`
    INSERT INTO job_outcomes (job_id, tenant, outcome, error, task, version, accepted_at)
    SELECT ${jobId}::uuid, ${tenant}, 'failed', ${error.slice(0, 500)}, ${task}, ${version},
      to_timestamp(${acceptedMs ?? null}::float8 / 1000)
    WHERE NOT EXISTS (SELECT 1 FROM summaries WHERE job_id = ${jobId}::uuid)
    ON CONFLICT (job_id) DO NOTHING
    RETURNING job_id`;
  if (inserted.length > 0) return "failed";
  const outcome = (await outcomesOf(sql, [jobId])).get(jobId);
  if (outcome) return outcome;
  // No row, yet the insert wrote none: a summary from before job_outcomes, or a row deleted meanwhile (a
  // replay, retention). Only a summary means done; otherwise decide nothing now and let a later delivery look.
  const [summary] = await sql`SELECT 1 FROM summaries WHERE job_id = ${jobId}::uuid`;
  if (summary) return "done";
  throw new Error(`job ${jobId}'s outcome changed while it was being decided failed`);
}

/**
 * Makes a failed job undecided, for a replay of its dead letter: deletes its
 * 'failed' outcome (a replay is the one step that takes a decision back, and
 * only that kind). A job with any other outcome or a summary, or whose
 * effects the caller found elsewhere (`hasOtherEffects`: its outbox row), has
 * had its effects (or a cancel) already and is left as it is.
 * @returns null when the job is now undecided, else what it already is.
 */
export async function reopenFailedJob(
  sql: Queryable,
  jobId: string,
  hasOtherEffects: boolean,
): Promise<"done" | "cancelled" | "expired" | null> {
  const [row] = await sql<{ outcome: Outcome | null; summary: boolean }[]>`
    SELECT (SELECT outcome FROM job_outcomes WHERE job_id = ${jobId}::uuid) AS outcome,
      EXISTS (SELECT 1 FROM summaries WHERE job_id = ${jobId}::uuid)
        OR EXISTS (SELECT 1 FROM run_results WHERE run_id = ${jobId}::uuid) AS summary`;
  if (row!.outcome === "cancelled" || row!.outcome === "expired") return row!.outcome;
  if (row!.outcome === "done" || row!.summary || hasOtherEffects) return "done";
  await sql`DELETE FROM job_outcomes WHERE job_id = ${jobId}::uuid AND outcome = 'failed'`;
  return null;
}

/** The summaries of `jobIds`, by job id; jobs without one (not done, or past retention) are absent. */
export async function summariesOf(sql: Queryable, jobIds: string[]): Promise<Map<string, string>> {
  const found = await sql<{ job_id: string; summary: string }[]>`
    SELECT job_id::text, summary FROM summaries WHERE job_id = ANY(${jobIds}::uuid[])`;
  return new Map(found.map((f) => [f.job_id, f.summary]));
}

/** A job as the API reads it: its outcome, summary, and the totals of its model attempts. */
export interface JobReadRow {
  tenant: string | null;
  outcome: Outcome | null;
  error: string | null;
  summary: string | null;
  /** The task and version it ran (null for a job not yet decided). */
  task: string | null;
  version: number | null;
  /** A task run's output (the parsed JSON value, or the text) and model; null for a summary job. */
  output: unknown;
  model: string | null;
  /** Whether a task run's result exists (a done run's output may be any JSON value, null included). */
  has_result: boolean;
  attempts: number;
  tokens: number | null;
  prompt_tokens: number | null;
  completion_tokens: number | null;
  /** What its calls were charged in USD, of those with a price; null when none had one. */
  cost_usd: number | null;
  /** Answered from the result cache (a task run's `run_results.cached`, or any run's `cache_hits` row). */
  cached: boolean;
  /** A done run's tokens as its commit wrote them (null: a summary, a cached run, or one committed before). */
  result_prompt_tokens: number | null;
  result_completion_tokens: number | null;
}

/**
 * Reads a job for `GET /v1/summaries/{id}`, in one query: its outcome (a
 * summary without one counts as done), its summary, and the totals of its
 * model attempts (those of `tenant` only). @returns its row, all
 * null (and 0 attempts) for an unknown job.
 */
export async function readJob(sql: Queryable, jobId: string, tenant: string): Promise<JobReadRow> {
  const [row] = await sql<JobReadRow[]>`
    SELECT coalesce(o.tenant, s.tenant) AS tenant, coalesce(o.outcome, CASE WHEN s.job_id IS NOT NULL THEN 'done' END)
        AS outcome, o.error, s.summary, o.task, o.version, r.output, r.model, r.run_id IS NOT NULL AS has_result,
      a.attempts, a.tokens, a.prompt_tokens, a.completion_tokens, a.cost_usd,
      r.prompt_tokens AS result_prompt_tokens, r.completion_tokens AS result_completion_tokens,
      coalesce(r.cached, false) OR EXISTS (SELECT 1 FROM cache_hits h WHERE h.run_id = j.job_id) AS cached
    FROM (SELECT ${jobId}::uuid AS job_id) j
    LEFT JOIN job_outcomes o USING (job_id) LEFT JOIN summaries s USING (job_id)
    LEFT JOIN run_results r ON r.run_id = j.job_id
    CROSS JOIN LATERAL (
      SELECT count(*)::int AS attempts,
        (sum(coalesce(prompt_tokens, 0) + coalesce(completion_tokens, 0)))::int AS tokens,
        (sum(coalesce(prompt_tokens, 0)))::int AS prompt_tokens,
        (sum(coalesce(completion_tokens, 0)))::int AS completion_tokens,
        sum(cost_usd)::float8 AS cost_usd
      FROM model_attempts m WHERE m.job_id = j.job_id AND m.tenant = ${tenant}
    ) a`;
  return row!;
}

/** A decided job with its summary, as the console shows it. */
export interface DecidedJob {
  tenant: string;
  outcome: string;
  decided_at: Date;
  summary: string | null;
}

/** A model attempt of a known job, as the console's job page lists it. */
export type JobAttempt = Omit<AttemptRow, "job_id" | "tenant">;

/** How many jobs each tenant finished in the last minute (tenants with none are absent). */
export async function doneLastMinute(sql: Queryable): Promise<{ tenant: string; n: number }[]> {
  return await sql<{ tenant: string; n: number }[]>`
    SELECT tenant, count(*)::int AS n FROM job_outcomes
    WHERE outcome = 'done' AND decided_at > now() - interval '1 minute' GROUP BY tenant`;
}

/** The largest value of a Postgres `integer` column. */
const INT4_MAX = 2_147_483_647;

/** A count as an `integer` column can hold it: a whole number from 0 to {@linkcode INT4_MAX}, else NULL. */
function storableCount(value: number | null | undefined): number | null {
  return typeof value === "number" && Number.isInteger(value) && value >= 0 && value <= INT4_MAX ? value : null;
}

/**
 * Inserts recorded model attempts, in one statement. Token counts and statuses an `integer` cannot hold (a
 * fraction, a negative, `1e15`, a string) are stored as NULL, unknown: one such value must not fail the
 * statement, which would lose every other row of the batch (other tenants' calls). Other bad values still fail
 * it; the attempt log then writes the batch in parts (`attempt_log.ts`).
 */
export async function insertAttempts(sql: Queryable, rows: AttemptRow[]): Promise<void> {
  const col = <K extends keyof AttemptRow>(k: K) => rows.map((r) => r[k]);
  const counts = (k: "prompt_tokens" | "completion_tokens" | "status") => col(k).map(storableCount);
  await sql`
    INSERT INTO model_attempts (job_id, tenant, delivery, attempt, started_at, duration_ms, outcome, status,
      prompt_tokens, completion_tokens, provider_request_id, model, error, task, version, cost_usd, deployment,
      charged_tokens)
    SELECT * FROM unnest(
      ${col("job_id")}::uuid[], ${col("tenant")}::text[], ${col("delivery")}::int[], ${col("attempt")}::int[],
      ${col("started_at").map((d) => d.toISOString())}::timestamptz[], ${col("duration_ms")}::float8[],
      ${col("outcome")}::text[], ${counts("status")}::int[],
      ${counts("prompt_tokens")}::int[], ${counts("completion_tokens")}::int[],
      ${col("provider_request_id") as (string | null)[]}::text[], ${col("model")}::text[],
      ${col("error") as (string | null)[]}::text[], ${col("task")}::text[], ${col("version")}::int[],
      ${col("cost_usd") as (string | null)[]}::numeric[], ${col("deployment")}::text[],
      ${col("charged_tokens").map((v) => v ?? null)}::bigint[]
    )`;
}

/**
 * Records the model call a provider batch made for one run (issue 43): its row carries the batch's id
 * (`model_attempts.batch_id`), and is written once per run and batch, however often the batch's output is read
 * (the unique index `model_attempts_batch_line`).
 * @returns whether this call wrote it (false: an earlier read did).
 */
export async function insertBatchAttempt(sql: Queryable, row: AttemptRow & { batch_id: string }): Promise<boolean> {
  const inserted = await sql`
    INSERT INTO model_attempts (job_id, tenant, delivery, attempt, started_at, duration_ms, outcome, status,
      prompt_tokens, completion_tokens, provider_request_id, model, error, task, version, cost_usd, deployment,
      charged_tokens, batch_id)
    VALUES (${row.job_id}::uuid, ${row.tenant}, ${row.delivery}, ${row.attempt}, ${row.started_at.toISOString()},
      ${row.duration_ms}, ${row.outcome}, ${storableCount(row.status)}, ${storableCount(row.prompt_tokens)},
      ${storableCount(row.completion_tokens)}, ${row.provider_request_id}, ${row.model}, ${row.error}, ${row.task},
      ${row.version}, ${row.cost_usd}::numeric, ${row.deployment}, ${row.charged_tokens ?? null}, ${row.batch_id}::uuid)
    ON CONFLICT (job_id, batch_id) WHERE batch_id IS NOT NULL DO NOTHING
    RETURNING id`;
  return inserted.length > 0;
}

/** A job's model attempts, oldest first. */
export async function attemptsOf(sql: Queryable, jobId: string): Promise<JobAttempt[]> {
  return await sql<JobAttempt[]>`
    SELECT delivery, attempt, started_at, duration_ms, outcome, status, prompt_tokens, completion_tokens,
      provider_request_id, model, error, task, version, cost_usd, deployment
    FROM model_attempts WHERE job_id = ${jobId} ORDER BY started_at`;
}

/** What a job's failed attempts were: how many, how (labels with counts), and whether others' calls succeeded meanwhile. */
export interface FailedAttempts {
  failed: number;
  how: string | null;
  others_ok: boolean;
}

/**
 * The job's failed model attempts, and whether the provider served other
 * jobs (an attempt that was ok) between its first and last failure.
 */
export async function failedAttemptsOf(sql: Queryable, jobId: string): Promise<FailedAttempts | undefined> {
  const [row] = await sql<FailedAttempts[]>`
    WITH mine AS (
      -- A call aborted by a worker's stop says nothing about the job or the provider.
      SELECT * FROM model_attempts WHERE job_id = ${jobId}::uuid AND outcome NOT IN ('ok', 'aborted')
    )
    SELECT (SELECT count(*) FROM mine)::int AS failed,
      (SELECT string_agg(label || ' ×' || n, ', ' ORDER BY n DESC) FROM (
        SELECT coalesce('http_' || status, error, 'unknown') AS label, count(*) AS n FROM mine GROUP BY 1
      ) k) AS how,
      EXISTS (
        SELECT 1 FROM model_attempts o
        WHERE o.outcome = 'ok' AND o.job_id <> ${jobId}::uuid
          AND o.started_at BETWEEN (SELECT min(started_at) FROM mine) AND (SELECT max(started_at) FROM mine)
      ) AS others_ok`;
  return row;
}

/** One line of the usage report: a tenant's calls to one model. */
export interface AttemptUsage {
  tenant: string;
  model: string;
  calls: number;
  jobs: number;
  prompt_tokens: number;
  completion_tokens: number;
  failures: number;
  retries: number;
  p50_ms: number;
  p99_ms: number;
}

/**
 * Deletes up to `limit` summaries older than `olderThanMs`, except those
 * `keep` matches (given the summary's job id column; the caller's rule, such
 * as "its notification is still unsent"). @returns rows deleted.
 */
export function deleteExpiredSummaries(
  sql: Queryable,
  { olderThanMs, limit, keep }: ExpiryBatch & { keep?: (jobId: Fragment) => Fragment },
): Promise<number> {
  const kept = keep ? sql`AND NOT ${keep(sql`t.job_id`)}` : sql``;
  const where = sql`${olderThan(sql, "created_at", olderThanMs)} ${kept}`;
  return deleteBatch(sql, { table: "summaries", key: "job_id", where, limit });
}

/**
 * Deletes up to `limit` task runs' results older than `olderThanMs`, except those `keep` matches (as
 * {@linkcode deleteExpiredSummaries}). @returns rows deleted.
 */
export function deleteExpiredRunResults(
  sql: Queryable,
  { olderThanMs, limit, keep }: ExpiryBatch & { keep?: (runId: Fragment) => Fragment },
): Promise<number> {
  const kept = keep ? sql`AND NOT ${keep(sql`t.run_id`)}` : sql``;
  const where = sql`${olderThan(sql, "created_at", olderThanMs)} ${kept}`;
  return deleteBatch(sql, { table: "run_results", key: "run_id", where, limit });
}

/**
 * Deletes up to `limit` outcome rows decided more than `olderThanMs` ago
 * whose summary is gone. @returns rows deleted.
 */
export function deleteExpiredOutcomes(sql: Queryable, { olderThanMs, limit }: ExpiryBatch): Promise<number> {
  const where = sql`${olderThan(sql, "decided_at", olderThanMs)}
    AND NOT EXISTS (SELECT 1 FROM summaries s WHERE s.job_id = t.job_id)
    AND NOT EXISTS (SELECT 1 FROM run_results r WHERE r.run_id = t.job_id)`;
  return deleteBatch(sql, { table: "job_outcomes", key: "job_id", where, limit });
}

/** Deletes up to `limit` recorded model attempts that started more than `olderThanMs` ago. @returns rows deleted. */
export function deleteExpiredAttempts(sql: Queryable, { olderThanMs, limit }: ExpiryBatch): Promise<number> {
  return deleteBatch(sql, {
    table: "model_attempts",
    key: "id",
    where: olderThan(sql, "started_at", olderThanMs),
    limit,
  });
}

/** The outputs of done task runs among `runIds`, by run id; runs without one (not done, or past retention) are absent. */
export async function runOutputsOf(sql: Queryable, runIds: string[]): Promise<Map<string, unknown>> {
  const found = await sql<{ run_id: string; output: unknown }[]>`
    SELECT run_id::text, output FROM run_results WHERE run_id = ANY(${runIds}::uuid[])`;
  return new Map(found.map((f) => [f.run_id, f.output]));
}

/**
 * One line of the usage report by task: a tenant's calls to one model for one task version, what they were
 * charged, and the runs the result cache answered instead (with what the hits saved).
 */
export interface TaskAttemptUsage extends Omit<AttemptUsage, "p50_ms" | "p99_ms"> {
  task: string;
  version: number;
  /** Null on a line of cache hits only. */
  p50_ms: number | null;
  p99_ms: number | null;
  /** What the calls were charged (`cost_usd`), in nano-dollars; null when none of them had a price. */
  cost_nanos: number | null;
  /** Calls recorded without a price (their model had none), which `cost_nanos` leaves out. */
  unpriced_calls: number;
  /** Of the calls, those made through a provider batch (a `batch_id`, priced at the model's batch prices). */
  batch_calls: number;
  /** Runs answered from the result cache (`cache_hits`), and the source runs' tokens and cost they saved. */
  cache_hits: number;
  saved_prompt_tokens: number;
  saved_completion_tokens: number;
  /** Null when no hit's source had a price. */
  saved_nanos: number | null;
}

/**
 * Model attempts and cache hits per tenant, task, task version and model since `sinceS` seconds ago (of
 * `tenant` only, if given). A summary job's attempts are those of `summarize` version 1. Costs are summed
 * as exact decimals and returned in whole nano-dollars, so that sums of lines stay exact.
 */
export async function taskAttemptUsage(
  sql: Queryable,
  { tenant, sinceS }: { tenant?: string; sinceS: number },
): Promise<TaskAttemptUsage[]> {
  const own = () => tenant === undefined ? sql`` : sql`AND tenant = ${tenant}`;
  return await sql<TaskAttemptUsage[]>`
    WITH a AS (
      SELECT tenant, task, version, model, count(*)::int AS calls, count(DISTINCT job_id)::int AS jobs,
        coalesce(sum(prompt_tokens), 0)::bigint::float8 AS prompt_tokens,
        coalesce(sum(completion_tokens), 0)::bigint::float8 AS completion_tokens,
        -- A call cut off by a worker's stop is no failure of the provider's or the input's.
        (count(*) FILTER (WHERE outcome NOT IN ('ok', 'aborted')))::int AS failures,
        (count(*) - count(DISTINCT job_id))::int AS retries,
        round(percentile_cont(0.5) WITHIN GROUP (ORDER BY duration_ms)::numeric, 1)::float8 AS p50_ms,
        round(percentile_cont(0.99) WITHIN GROUP (ORDER BY duration_ms)::numeric, 1)::float8 AS p99_ms,
        (sum(cost_usd) * 1000000000)::bigint::float8 AS cost_nanos,
        (count(*) FILTER (WHERE cost_usd IS NULL))::int AS unpriced_calls,
        (count(*) FILTER (WHERE batch_id IS NOT NULL))::int AS batch_calls
      FROM model_attempts
      WHERE started_at >= now() - ${sinceS} * interval '1 second' ${own()}
      GROUP BY tenant, task, version, model
    ), h AS (
      SELECT tenant, task, version, model, count(*)::int AS cache_hits,
        sum(saved_prompt_tokens)::bigint::float8 AS saved_prompt_tokens,
        sum(saved_completion_tokens)::bigint::float8 AS saved_completion_tokens,
        (sum(saved_usd) * 1000000000)::bigint::float8 AS saved_nanos
      FROM cache_hits
      WHERE created_at >= now() - ${sinceS} * interval '1 second' ${own()}
      GROUP BY tenant, task, version, model
    )
    SELECT coalesce(a.tenant, h.tenant) AS tenant, coalesce(a.task, h.task) AS task,
      coalesce(a.version, h.version) AS version, coalesce(a.model, h.model) AS model,
      coalesce(a.calls, 0) AS calls, coalesce(a.jobs, 0) AS jobs,
      coalesce(a.prompt_tokens, 0) AS prompt_tokens, coalesce(a.completion_tokens, 0) AS completion_tokens,
      coalesce(a.failures, 0) AS failures, coalesce(a.retries, 0) AS retries, a.p50_ms, a.p99_ms,
      a.cost_nanos, coalesce(a.unpriced_calls, 0) AS unpriced_calls, coalesce(a.batch_calls, 0) AS batch_calls,
      coalesce(h.cache_hits, 0) AS cache_hits, coalesce(h.saved_prompt_tokens, 0) AS saved_prompt_tokens,
      coalesce(h.saved_completion_tokens, 0) AS saved_completion_tokens, h.saved_nanos
    FROM a FULL JOIN h ON a.tenant = h.tenant AND a.task = h.task AND a.version = h.version AND a.model = h.model
    ORDER BY 1, 2, 3, 4`;
}

/** A decided run as the console shows it: how it ended, its task version, and its result. */
export interface DecidedRun extends DecidedJob {
  error: string | null;
  task: string;
  version: number;
  /** A done task run's input (not summarize's: its document is not kept). */
  input: unknown;
  /** A done task run's output: the parsed JSON value with an output schema, else the text. */
  output: unknown;
  model: string | null;
  cached: boolean | null;
  /** When an expired run expired; null for every other outcome. */
  expires_at: Date | null;
}

/**
 * The run's outcome, task version and result (its summary, or a task run's
 * input and output): one row if it is decided, none otherwise.
 */
export async function decidedRun(sql: Queryable, runId: string): Promise<DecidedRun | undefined> {
  const [decided] = await sql<DecidedRun[]>`
    SELECT o.tenant, o.outcome, o.decided_at, o.error, o.task, o.version, s.summary, r.input, r.output, r.model,
      r.cached, o.expires_at
    FROM job_outcomes o LEFT JOIN summaries s USING (job_id) LEFT JOIN run_results r ON r.run_id = o.job_id
    WHERE o.job_id = ${runId}::uuid`;
  return decided;
}

/** The task version an undecided run's model attempts name; undefined before its first recorded attempt. */
export async function attemptedTaskOf(
  sql: Queryable,
  runId: string,
): Promise<{ task: string; version: number } | undefined> {
  const [row] = await sql<{ task: string; version: number }[]>`
    SELECT task, version FROM model_attempts WHERE job_id = ${runId}::uuid ORDER BY started_at LIMIT 1`;
  return row;
}

/**
 * What `tenant`'s calls were charged in the current UTC day and month, by Postgres's clock: each call at what it
 * was charged against the budgets (`charged_tokens`, else its reported tokens; `cost_usd`), so a call charged its
 * reservation counts its reservation, not 0. One query on the `(tenant, started_at)` index (the budgets seed a
 * lost hash from it).
 */
export async function chargedThisPeriod(
  sql: Queryable,
  tenant: string,
): Promise<{ day: { tokens: number; usd: number }; month: { tokens: number; usd: number } }> {
  const [row] = await sql<{ day_tok: string; day_usd: string; month_tok: string; month_usd: string }[]>`
    SELECT
      COALESCE(sum(COALESCE(charged_tokens, COALESCE(prompt_tokens, 0) + COALESCE(completion_tokens, 0)))
        FILTER (WHERE started_at >= date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'), 0)::text AS day_tok,
      COALESCE(sum(cost_usd) FILTER (WHERE started_at >= date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'), 0)::text AS day_usd,
      COALESCE(sum(COALESCE(charged_tokens, COALESCE(prompt_tokens, 0) + COALESCE(completion_tokens, 0))), 0)::text AS month_tok,
      COALESCE(sum(cost_usd), 0)::text AS month_usd
    FROM model_attempts
    WHERE tenant = ${tenant}
      AND started_at >= date_trunc('month', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'`;
  return {
    day: { tokens: Number(row!.day_tok), usd: Number(row!.day_usd) },
    month: { tokens: Number(row!.month_tok), usd: Number(row!.month_usd) },
  };
}
