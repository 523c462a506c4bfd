/**
 * The batch store: the one module that reads and writes `batches` and `batch_runs` (migration 020, whose header
 * lists a batch's states). One SQL operation per function. Every move of a batch from one state to the next is a
 * compare-and-set on its state, so a step replayed by a second process, or by a process that outlived its
 * lease, changes nothing.
 */
import type { Sql } from "postgres";
import type { Queryable } from "../db/queryable.ts";

/** A batch's state (see migration 020). */
export type BatchState =
  | "open"
  | "closed"
  | "uploading"
  | "uploaded"
  | "creating"
  | "submitted"
  | "ended"
  | "committed";

/** A batch as stored. */
export interface BatchRow {
  id: string;
  deployment: string;
  model: string;
  state: BatchState;
  runs: number;
  opened_at: Date;
  closed_at: Date | null;
  creating_at: Date | null;
  input_file_id: string | null;
  provider_batch_id: string | null;
  provider_status: string | null;
  output_file_id: string | null;
  error_file_id: string | null;
  ended_at: Date | null;
  committed_at: Date | null;
  /**
   * The lease a process took it with (`lease_until`, as Postgres's text, to the microsecond): its token. Compared
   * as `::text::timestamptz`: a parameter typed timestamptz goes through postgres.js's Date, to the millisecond.
   */
  lease?: string;
}

/** A run to record into its deployment's and model's open batch. */
export interface NewBatchRun {
  runId: string;
  tenant: string;
  deployment: string;
  model: string;
  payload: string;
  request: Record<string, unknown>;
  acceptedMs?: number;
  /** The worst case its line holds against the tenant's budgets (undefined: no budget, nothing held). */
  held?: { tokens: number; nanos: number };
}

/** A run of a batch, as its line is settled. */
export interface BatchRunRow {
  run_id: string;
  tenant: string;
  payload: string;
  request: Record<string, unknown>;
  accepted_ms: number | null;
  in_file: boolean | null;
  settled: string | null;
  /** The tokens its line holds against the tenant's budgets (migration 023); null: nothing held. */
  held_tokens: string | null;
}

/**
 * Records a run into the open batch of its deployment and model (opening one if there is none), and closes that
 * batch when it reaches `maxRuns`. The open batch's row lock serialises the runs recorded into it, so its count
 * is exact and a batch being closed takes no more runs.
 * @returns the batch the run is in, and whether this call recorded it (false: a delivery before did).
 */
export async function recordBatchRun(
  sql: Sql,
  run: NewBatchRun,
  { maxRuns }: { maxRuns: number },
): Promise<{ batchId: string; recorded: boolean }> {
  return await sql.begin(async (tx) => {
    const [already] = await tx<{ batch_id: string }[]>`
      SELECT batch_id::text FROM batch_runs WHERE run_id = ${run.runId}::uuid`;
    if (already) return { batchId: already.batch_id, recorded: false };
    await tx`
      INSERT INTO batches (id, deployment, model) VALUES (${crypto.randomUUID()}::uuid, ${run.deployment}, ${run.model})
      ON CONFLICT (deployment, model) WHERE state = 'open' DO NOTHING`;
    const [open] = await tx<{ id: string; runs: number }[]>`
      SELECT id::text, runs FROM batches WHERE deployment = ${run.deployment} AND model = ${run.model} AND state = 'open'
      FOR UPDATE`;
    // Closed between the insert and the lock: the caller tries again (a new open batch).
    if (!open) throw new BatchClosedMeanwhile(run.deployment, run.model);
    const inserted = await tx`
      INSERT INTO batch_runs (run_id, batch_id, tenant, payload, request, accepted_ms, held_tokens, held_nanos)
      VALUES (${run.runId}::uuid, ${open.id}::uuid, ${run.tenant}, ${run.payload}, ${tx.json(run.request as never)},
        ${run.acceptedMs ?? null}, ${run.held ? Math.ceil(run.held.tokens) : null},
        ${run.held ? Math.ceil(run.held.nanos) : null})
      ON CONFLICT (run_id) DO NOTHING
      RETURNING run_id`;
    if (inserted.length === 0) {
      const [other] = await tx<{ batch_id: string }[]>`
        SELECT batch_id::text FROM batch_runs WHERE run_id = ${run.runId}::uuid`;
      return { batchId: other?.batch_id ?? open.id, recorded: false };
    }
    await tx`
      UPDATE batches SET runs = runs + 1, updated_at = now(),
        state = CASE WHEN runs + 1 >= ${maxRuns} THEN 'closed' ELSE state END,
        closed_at = CASE WHEN runs + 1 >= ${maxRuns} THEN now() ELSE closed_at END
      WHERE id = ${open.id}::uuid`;
    return { batchId: open.id, recorded: true };
  });
}

/** The open batch was closed while a run was being recorded into it: record it again (into a new one). */
export class BatchClosedMeanwhile extends Error {
  constructor(deployment: string, model: string) {
    super(`the open batch of ${deployment}/${model} was closed meanwhile`);
    this.name = "BatchClosedMeanwhile";
  }
}

/** Closes the open batches that have collected for `maxWaitMs`. @returns how many. */
export async function closeDueBatches(sql: Queryable, { maxWaitMs }: { maxWaitMs: number }): Promise<number> {
  const rows = await sql`
    UPDATE batches SET state = 'closed', closed_at = now(), updated_at = now()
    WHERE state = 'open' AND opened_at <= now() - make_interval(secs => ${maxWaitMs / 1000})
    RETURNING id`;
  return rows.length;
}

/**
 * Takes the oldest unfinished batch in one of `states` that nobody holds (or whose holder's lease ran out), for
 * `leaseMs`, or, given `shortestMs`, for a quarter of its age since its creation bounded by the two (the poller's
 * back-off: a young batch is looked at again soon, an old one every `leaseMs`).
 * @returns it, or undefined when there is none.
 */
export async function leaseBatch(
  sql: Queryable,
  states: readonly BatchState[],
  { leaseMs, shortestMs = leaseMs }: { leaseMs: number; shortestMs?: number },
): Promise<BatchRow | undefined> {
  // A quarter of the batch's age since its creation (its opening before that), between the two bounds.
  const [row] = await sql<BatchRow[]>`
    UPDATE batches SET lease_until = now() + LEAST(
      GREATEST((now() - coalesce(creating_at, opened_at)) / 4, make_interval(secs => ${shortestMs / 1000})),
      make_interval(secs => ${leaseMs / 1000}))
    WHERE id = (
      SELECT id FROM batches
      WHERE state = ANY(${states as string[]}::text[]) AND (lease_until IS NULL OR lease_until <= now())
      ORDER BY opened_at LIMIT 1 FOR UPDATE SKIP LOCKED
    )
    RETURNING id::text, deployment, model, state, runs, opened_at, closed_at, creating_at, input_file_id,
      provider_batch_id, provider_status, output_file_id, error_file_id, ended_at, committed_at,
      lease_until::text AS lease`;
  return row;
}

/**
 * Extends the lease `batch` was taken with by `leaseMs` from now, if it is still that lease (no other process
 * took the batch after it ran out). @returns the batch with its new lease, or undefined when it was lost.
 */
export async function renewLease(sql: Queryable, batch: BatchRow, leaseMs: number): Promise<BatchRow | undefined> {
  const [row] = await sql<{ lease: string }[]>`
    UPDATE batches SET lease_until = now() + make_interval(secs => ${leaseMs / 1000})
    WHERE id = ${batch.id}::uuid AND lease_until = ${batch.lease ?? null}::text::timestamptz
    RETURNING lease_until::text AS lease`;
  return row ? { ...batch, lease: row.lease } : undefined;
}

/** A batch's lease was lost, or may have lapsed, while this process worked on it. */
export class LeaseLost extends Error {
  constructor(id: string) {
    super(`the lease on batch ${id} was lost`);
    this.name = "LeaseLost";
  }
}

/** What a step holding a batch's lease gets (`whileLeased`). */
export interface HeldLease {
  /** Aborted once the lease is lost, or may lapse before a renewal can confirm it (renewals failing). */
  signal: AbortSignal;
  /** Renews the lease now, checking it is still this process's: before an effect no later step can undo. */
  confirm(): Promise<void>;
}

/**
 * Runs `work` on `batch` while holding the lease it was taken with: renewed every third of `leaseMs` until `work`
 * ends, then given back. A process killed mid-step holds the batch for at most `leaseMs` more, so the next one
 * resumes it soon; a step that takes longer (a large upload) keeps it. When `work` fails the lease is kept to its
 * end (the next try waits that long). `work`'s signal aborts when a renewal finds the lease taken (this process
 * stalled past it), or when renewals have failed until the lease could lapse within a third of it (Postgres out
 * of reach): another process may take the batch from then on, so the step stops its provider call, and `onLost`
 * is told.
 */
export async function whileLeased<T>(
  sql: Queryable,
  batch: BatchRow,
  leaseMs: number,
  work: (lease: HeldLease) => Promise<T>,
  onLost: () => void = () => {},
): Promise<T> {
  let held: BatchRow | undefined = batch;
  const lost = new AbortController();
  const lose = () => {
    if (lost.signal.aborted) return;
    held = undefined;
    lost.abort(new LeaseLost(batch.id));
    onLost();
  };
  // Until when the lease surely holds: `leaseMs` after the last renewal that was sent and confirmed.
  let validUntil = performance.now() + leaseMs;
  const renew = async () => {
    if (!held) throw new LeaseLost(batch.id);
    const sent = performance.now();
    const renewed = await renewLease(sql, held, leaseMs);
    if (!renewed) {
      lose();
      throw new LeaseLost(batch.id);
    }
    held = renewed;
    validUntil = sent + leaseMs;
  };
  let pending: Promise<void> | undefined;
  const timer = leaseMs >= 30
    ? setInterval(() => {
      if (!held) return;
      // Checked before a renewal still in flight is waited for: one that hangs (Postgres unreachable) confirms nothing.
      if (performance.now() > validUntil - leaseMs / 3) return lose();
      if (pending) return;
      pending = renew().catch(() => {}).finally(() => pending = undefined);
    }, leaseMs / 3)
    : undefined;
  try {
    const result = await work({
      signal: lost.signal,
      confirm: async () => {
        await pending;
        await renew();
      },
    });
    clearInterval(timer);
    // A renewal in flight would move the token the release names (a lost lease has nothing to give back, and its
    // renewal may hang as long as Postgres does).
    if (held) await pending;
    if (held) await releaseBatch(sql, held);
    return result;
  } finally {
    clearInterval(timer);
  }
}

/**
 * Gives a batch's lease back (its holder is done with it for now): only the lease `batch` holds, given one, so a
 * process whose lease ran out does not free a batch another has taken since.
 */
export async function releaseBatch(sql: Queryable, batch: Pick<BatchRow, "id" | "lease">): Promise<void> {
  await sql`
    UPDATE batches SET lease_until = NULL
    WHERE id = ${batch.id}::uuid AND (${batch.lease ?? null}::text::timestamptz IS NULL OR lease_until = ${
    batch.lease ?? null
  }::text::timestamptz)`;
}

/**
 * The upload intent: fixes which runs of a closed batch are in its file (those not decided yet: a run cancelled
 * meanwhile is left out), and moves it to `uploading`. @returns how many lines the file has, or null when the
 * batch was not `closed` (another process moved it).
 */
export async function fixBatchLines(sql: Sql, id: string): Promise<number | null> {
  return await sql.begin(async (tx) => {
    const moved = await tx`
      UPDATE batches SET state = 'uploading', updated_at = now() WHERE id = ${id}::uuid AND state = 'closed'
      RETURNING id`;
    if (moved.length === 0) return null;
    const rows = await tx<{ in_file: boolean }[]>`
      UPDATE batch_runs r SET
        in_file = NOT EXISTS (SELECT 1 FROM job_outcomes o WHERE o.job_id = r.run_id),
        settled = CASE WHEN EXISTS (SELECT 1 FROM job_outcomes o WHERE o.job_id = r.run_id) THEN 'left_out' END
      WHERE batch_id = ${id}::uuid
      RETURNING in_file`;
    return rows.filter((r) => r.in_file).length;
  });
}

/** The lines of a batch's file: its runs in the file, in a stable order. */
export async function batchLines(
  sql: Queryable,
  id: string,
): Promise<{ run_id: string; request: Record<string, unknown> }[]> {
  return await sql<{ run_id: string; request: Record<string, unknown> }[]>`
    SELECT run_id::text, request FROM batch_runs WHERE batch_id = ${id}::uuid AND in_file ORDER BY run_id`;
}

/** The runs of a batch (all of them), to settle its lines. */
export async function batchRuns(sql: Queryable, id: string): Promise<BatchRunRow[]> {
  return await sql<BatchRunRow[]>`
    SELECT run_id::text, tenant, payload, request, accepted_ms, in_file, settled, held_tokens::text
    FROM batch_runs WHERE batch_id = ${id}::uuid`;
}

/**
 * A tenant's batch lines that hold their worst case and are neither settled nor charged yet (no `model_attempts`
 * row): what a budget hash rebuilt from the record holds again (migration 023).
 */
export async function heldLines(
  sql: Queryable,
  tenant: string,
): Promise<{ id: string; tokens: number; nanos: number }[]> {
  const rows = await sql<{ id: string; tokens: string; nanos: string }[]>`
    SELECT r.run_id::text AS id, r.held_tokens::text AS tokens, COALESCE(r.held_nanos, 0)::text AS nanos
    FROM batch_runs r
    WHERE r.tenant = ${tenant} AND r.settled IS NULL AND r.held_tokens IS NOT NULL
      AND NOT EXISTS (SELECT 1 FROM model_attempts a WHERE a.job_id = r.run_id AND a.batch_id = r.batch_id)`;
  return rows.map((r) => ({ id: r.id, tokens: Number(r.tokens), nanos: Number(r.nanos) }));
}

/**
 * Which of these runs' batch lines are still in flight, for the holds' sweep: recorded and not settled. A run with
 * no line is not in the map.
 */
export async function lineVerdicts(sql: Queryable, ids: readonly string[]): Promise<Map<string, { live: boolean }>> {
  const rows = await sql<{ id: string; settled: string | null }[]>`
    SELECT run_id::text AS id, settled FROM batch_runs WHERE run_id = ANY(${ids as string[]}::uuid[])`;
  return new Map(rows.map((r) => [r.id, { live: r.settled === null }]));
}

/** How a run's line was settled (`batch_runs.settled`): `left_out` is set by {@linkcode fixBatchLines}. */
export type BatchLineOutcome = "committed" | "failed" | "online" | "left_out";

/**
 * Records how a run's line was settled (once; a second settling of the same run changes nothing).
 * @returns the deployment of the run's batch when this call settled it; undefined when it was settled before.
 */
export async function settleBatchRun(
  sql: Queryable,
  runId: string,
  settled: Exclude<BatchLineOutcome, "left_out">,
): Promise<string | undefined> {
  const [row] = await sql<{ deployment: string }[]>`
    UPDATE batch_runs r SET settled = ${settled} FROM batches b
    WHERE r.run_id = ${runId}::uuid AND r.settled IS NULL AND b.id = r.batch_id
    RETURNING b.deployment`;
  return row?.deployment;
}

/**
 * Moves a batch from `from` to `to`, with the columns the new state records.
 * @returns whether it moved (false: it was not in `from`; another process moved it).
 */
export async function moveBatch(
  sql: Queryable,
  id: string,
  from: BatchState,
  to: BatchState,
  set: Partial<
    Pick<BatchRow, "input_file_id" | "provider_batch_id" | "provider_status" | "output_file_id" | "error_file_id">
  > = {},
): Promise<boolean> {
  const rows = await sql`
    UPDATE batches SET state = ${to}, updated_at = now(),
      input_file_id = COALESCE(${set.input_file_id ?? null}, input_file_id),
      provider_batch_id = COALESCE(${set.provider_batch_id ?? null}, provider_batch_id),
      provider_status = COALESCE(${set.provider_status ?? null}, provider_status),
      output_file_id = COALESCE(${set.output_file_id ?? null}, output_file_id),
      error_file_id = COALESCE(${set.error_file_id ?? null}, error_file_id),
      creating_at = CASE WHEN ${to} = 'creating' THEN now() ELSE creating_at END,
      ended_at = CASE WHEN ${to} = 'ended' THEN now() ELSE ended_at END,
      committed_at = CASE WHEN ${to} = 'committed' THEN now() ELSE committed_at END
    WHERE id = ${id}::uuid AND state = ${from}
    RETURNING id`;
  return rows.length > 0;
}

/** Records the provider's status of a batch in flight (as polled). */
export async function notePolled(sql: Queryable, id: string, status: string): Promise<void> {
  // Only while in flight: a slow poll's late answer does not overwrite the status another poller ended it with.
  await sql`
    UPDATE batches SET provider_status = ${status}, updated_at = now() WHERE id = ${id}::uuid AND state = 'submitted'`;
}

/** Batches in flight, and those finished within `recentMs`, newest first (for `batches list`). */
export async function listBatches(sql: Queryable, { recentMs, limit = 200 }: { recentMs: number; limit?: number }) {
  return await sql<BatchRow[]>`
    SELECT id::text, deployment, model, state, runs, opened_at, closed_at, creating_at, input_file_id,
      provider_batch_id, provider_status, output_file_id, error_file_id, ended_at, committed_at
    FROM batches
    WHERE state <> 'committed' OR committed_at > now() - make_interval(secs => ${recentMs / 1000})
    ORDER BY opened_at DESC LIMIT ${limit}`;
}

/** The batch a queued run waits in, if it is recorded in one not yet committed (`waiting_for: "batch"`). */
export async function batchOfRun(sql: Queryable, runId: string): Promise<string | undefined> {
  const [row] = await sql<{ batch_id: string }[]>`
    SELECT r.batch_id::text FROM batch_runs r JOIN batches b ON b.id = r.batch_id
    WHERE r.run_id = ${runId}::uuid AND r.settled IS NULL`;
  return row?.batch_id;
}

/** Batches not committed, by deployment and state, as the metrics read them (see {@linkcode batchesInFlight}). */
export interface InFlightBatches {
  deployment: string;
  state: Exclude<BatchState, "committed">;
  batches: number;
  /** Their runs whose lines are not settled yet. */
  runs_waiting: number;
  /** The age of the oldest of them, from its `opened_at`, by Postgres's clock. */
  oldest_s: number;
}

/**
 * The batches not committed, by deployment and state: how many, their runs not settled, and the oldest's age. One
 * query that reads no committed batch (`batches_unfinished`) and, of `batch_runs`, only the unsettled runs of
 * those batches (`batch_runs_unsettled`, migration 021): its cost follows what is in flight, not the history.
 */
export async function batchesInFlight(sql: Queryable): Promise<InFlightBatches[]> {
  return await sql<InFlightBatches[]>`
    SELECT b.deployment, b.state, count(*)::int AS batches, sum(w.n)::int AS runs_waiting,
      extract(epoch FROM now() - min(b.opened_at))::float8 AS oldest_s
    FROM batches b
    CROSS JOIN LATERAL (
      SELECT count(*) AS n FROM batch_runs r WHERE r.batch_id = b.id AND r.settled IS NULL
    ) w
    WHERE b.state <> 'committed'
    GROUP BY b.deployment, b.state`;
}
