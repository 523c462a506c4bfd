/**
 * The batch poller: polls the provider batches in flight (`submitted`), records their end (`ended`, with the
 * output and error file ids), then settles every line (`committed`):
 *
 * - an output line (status 200) is the run's answer: its `model_attempts` row (marked with the batch's id, priced
 *   at the model's batch prices) and then its result and notification through the same group commit and outbox
 *   as every run. A line read twice commits once: the row's unique index and `job_outcomes`' primary key decide.
 * - an error line fails its run as a model error would (`failRun`, with its `run.failed` notification); a
 *   transient one (429, 5xx) goes to the online path instead, whatever `BATCH_ON_EXPIRY` says.
 * - a line the batch never finished (`batch_expired`, `batch_cancelled`, or missing: a batch that failed
 *   validation) follows `BATCH_ON_EXPIRY`: the online path, or a failure.
 *
 * Each run's line is settled in `batch_runs.settled` after its effects: a process killed between two lines leaves
 * the batch `ended`, and the next one reads the files again and settles only what is not settled yet.
 */
import type { Sql } from "postgres";
import type { Logger } from "../log/logger.ts";
import { chargeNanos } from "../budgets/charge.ts";
import type { Budgets } from "../budgets/budgets.ts";
import type { Prices } from "../llm/prices.ts";
import { insertBatchAttempt } from "../jobs/job_store.ts";
import { failRun, type GroupCommitter, type JobResult } from "../runs/commit.ts";
import { runOfPayload } from "../runs/run_payload.ts";
import { type BatchClient, ENDED_STATUSES } from "./batch_client.ts";
import {
  type BatchLineOutcome,
  type BatchRow,
  type BatchRunRow,
  batchRuns,
  leaseBatch,
  moveBatch,
  notePolled,
  releaseBatch,
  settleBatchRun,
  whileLeased,
} from "./batch_store.ts";
import { passEvery } from "./_pass_loop.ts";

/** One line of a batch's output or error file (openai-node's `BatchRequestOutput`). */
interface OutputLine {
  custom_id: string;
  response?: {
    status_code?: number;
    request_id?: string;
    body?: {
      choices?: { message?: { content?: string | null } }[];
      usage?: { prompt_tokens?: number; completion_tokens?: number };
      error?: { message?: string; code?: string | null };
    };
  } | null;
  error?: { code?: string; message?: string } | null;
}

/** A run of an unfinished line, sent to the online path. */
export interface OnlineRun {
  runId: string;
  tenant: string;
  payload: string;
  acceptedMs?: number;
  /**
   * A structured run's answer from its batch line: the worker checks it against the task's output schema (with
   * its one repair call, online, when it fails) and commits it, with no first call.
   */
  answer?: { text: string; model: string };
}

/** Defaults of {@linkcode createBatchPoller}. */
export const POLLER_DEFAULTS = {
  /**
   * How often a batch in flight is polled (its lease between polls): a quarter of its age since its creation,
   * from `firstPollMs` to `pollMs`. So a batch is first polled a second after its creation, and one the provider
   * takes hours over is polled every 30 s (OpenAI's batches take minutes to hours; polls are not billed but are
   * rate limited).
   */
  pollMs: 30_000,
  firstPollMs: 1_000,
  /**
   * How long a process holds an ended batch while it settles its lines, renewed every third of it while it does:
   * how long a batch whose process was killed mid-commit waits before the next one resumes it.
   */
  leaseMs: 30_000,
  intervalMs: 1_000,
  perPass: 20,
} as const;

/** Options for {@linkcode createBatchPoller}. */
export interface PollerOptions {
  /**
   * BATCH_ON_EXPIRY: what becomes of a run whose line the batch never finished (an expired, cancelled or failed
   * batch). Not a transient error line (429, 5xx): that one always goes online.
   */
  onExpiry: "online" | "fail";
  /**
   * Puts a run back on the online path (its lane's low stream). Without it, such runs fail (a transient error
   * line too). A run sent twice (a stop between the send and its record) is still committed once: its outcome
   * decides.
   */
  online?: (run: OnlineRun) => Promise<unknown>;
  /** Model prices: each line's `cost_usd`, at the batch prices (`batch_in`, `batch_out`, else the online ones). */
  prices?: Prices;
  /**
   * Tenant budgets: a line that holds its worst case (taken when its run was collected) has its hold settled at
   * its usage at the batch prices once its `model_attempts` row is written, or released when it ends without an
   * answer; a line collected without a hold (no budget then) has its usage charged.
   */
  budgets?: Pick<Budgets, "charge" | "settleHold">;
  /** The longest time between two polls of a batch. */
  pollMs?: number;
  /** The shortest time between two polls of a batch (at most `pollMs`). */
  firstPollMs?: number;
  leaseMs?: number;
  intervalMs?: number;
  /** Called once for each line this poller settled (a line settled before is not counted again): the metrics. */
  onSettled?: (outcome: BatchLineOutcome, lines: number, deployment: string) => void;
  /** Called after each line's settling (tests throw here to stop the poller between two lines). */
  fault?: (step: "line_settled" | "online_sent", runId: string) => void | Promise<void>;
}

/** The poller service. */
export interface BatchPoller {
  /** One pass: polls the batches due, then settles the ended ones. @returns how many batches it settled. */
  runOnce(): Promise<number>;
  run(signal: AbortSignal): Promise<void>;
}

/** Whole nano-dollars as an exact decimal of USD, for `model_attempts.cost_usd`. */
function decimalUsd(nanos: number): string {
  const digits = String(nanos).padStart(10, "0");
  return `${digits.slice(0, -9)}.${digits.slice(-9)}`;
}

/** A batch file's lines (none without a file). */
async function readLines(client: BatchClient, fileId: string | null): Promise<OutputLine[]> {
  if (!fileId) return [];
  return (await client.content(fileId)).split("\n").filter((l) => l.trim() !== "").map((l) => JSON.parse(l));
}

/** A batch run as the commit and `failRun` name it. */
function runOf(row: BatchRunRow) {
  const run = runOfPayload(row.payload);
  return {
    run,
    ref: {
      jobId: row.run_id,
      tenant: row.tenant,
      task: run.task,
      version: run.version,
      notify: run.notify,
      acceptedMs: row.accepted_ms ?? undefined,
    },
  };
}

/**
 * A line's `model_attempts` row: marked with its batch's id (what makes it a batch call), priced at the model's
 * batch prices, its tokens charged as reported. Its `started_at` is when it is charged (now), not when its batch
 * was created: the budgets count a day's and a month's spend from the rows by `started_at`, and the line's charge
 * is spent in the period it settles in, so a hash rebuilt from the record counts it where the live hash did (a
 * batch created before midnight and settled after it counts in the day it settled). `duration_ms` is still the
 * batch's, from its creation to its end.
 */
function attemptOf(batch: BatchRow, row: BatchRunRow, line: OutputLine, prices: Prices | undefined) {
  const status = line.response?.status_code ?? null;
  const usage = status === 200 ? line.response?.body?.usage : undefined;
  const prompt = usage?.prompt_tokens ?? 0;
  const completion = usage?.completion_tokens ?? 0;
  const nanos = chargeNanos({ prompt, completion }, prices?.of(batch.model), true);
  const { run } = runOf(row);
  const started = batch.creating_at ?? batch.opened_at;
  return {
    job_id: row.run_id,
    tenant: row.tenant,
    delivery: 0,
    attempt: 1,
    started_at: new Date(),
    duration_ms: Math.max(0, (batch.ended_at?.getTime() ?? Date.now()) - started.getTime()),
    outcome: status === 200 ? "ok" : "give_up",
    status,
    prompt_tokens: usage ? prompt : null,
    completion_tokens: usage ? completion : null,
    provider_request_id: line.response?.request_id ?? null,
    model: batch.model,
    error: status === 200 ? null : `UpstreamHttpError ${status}`,
    task: run.task,
    version: run.version,
    cost_usd: nanos === undefined ? null : decimalUsd(nanos),
    deployment: batch.deployment,
    charged_tokens: prompt + completion,
    batch_id: batch.id,
  };
}

/**
 * Charges a line's reported usage to its tenant's budgets at the batch prices, once per line: its hold is settled at
 * that charge (nothing for an error line), or, for a line that holds nothing, the usage is charged under the
 * line's id. A hold's settlement that fails throws: the line stays unsettled, and the next pass reads it again and
 * settles it (once: a hold goes once). A charge without a hold that fails is logged: the record stands (the row is
 * written), and a hash rebuilt from the record counts the row.
 */
async function chargeLine(
  budgets: Pick<Budgets, "charge" | "settleHold">,
  log: Logger,
  batch: BatchRow,
  row: BatchRunRow,
  attempt: ReturnType<typeof attemptOf>,
) {
  if (row.held_tokens !== null) {
    const charged = { tokens: attempt.charged_tokens, nanos: Math.round(Number(attempt.cost_usd ?? 0) * 1e9) };
    return await budgets.settleHold(row.tenant, row.run_id, charged);
  }
  if (attempt.charged_tokens <= 0) return;
  const used = { prompt: attempt.prompt_tokens ?? 0, completion: attempt.completion_tokens ?? 0 };
  await budgets.charge(row.tenant, batch.model, used, { id: `${batch.id}:${row.run_id}`, batch: true })
    .catch((error) => log.warn("batch_budget_charge_failed", { run_id: row.run_id, tenant: row.tenant, error }));
}

const UNFINISHED_CODES = new Set(["batch_expired", "batch_cancelled"]);

/** Whether a run's line asked for an answer in its task's output schema (`response_format`, as the online call). */
function structured(row: BatchRunRow): boolean {
  return (row.request.response_format as { type?: string } | undefined)?.type === "json_schema";
}

/**
 * A line that ends without an answer charges nothing: its hold goes (before an online send, so that the run's own
 * reservation is not refused for it). A failure throws: the line stays unsettled until a later pass releases it.
 */
async function releaseHold(budgets: PollerOptions["budgets"], row: BatchRunRow): Promise<void> {
  if (row.held_tokens === null || !budgets) return;
  await budgets.settleHold(row.tenant, row.run_id, { tokens: 0, nanos: 0 });
}

/** Polls a batch in flight at its provider: records its status, and when it has ended, its files (`ended`). */
async function poll(sql: Sql, log: Logger, batch: BatchRow, client: BatchClient): Promise<void> {
  const provider = await client.retrieve(batch.provider_batch_id!);
  if (!ENDED_STATUSES.has(provider.status)) return await notePolled(sql, batch.id, provider.status);
  await moveBatch(sql, batch.id, "submitted", "ended", {
    provider_status: provider.status,
    output_file_id: provider.output_file_id ?? null,
    error_file_id: provider.error_file_id ?? null,
  });
  log.info("batch_ended", { batch_id: batch.id, provider_status: provider.status });
  await releaseBatch(sql, batch);
}

/** The poller over the batch deployments' clients (by deployment name). */
export function createBatchPoller(
  { sql, clients, log, committer }: {
    sql: Sql;
    clients: ReadonlyMap<string, BatchClient>;
    log: Logger;
    committer: GroupCommitter;
  },
  options: PollerOptions,
): BatchPoller {
  const pollMs = options.pollMs ?? POLLER_DEFAULTS.pollMs;
  const firstPollMs = Math.min(options.firstPollMs ?? POLLER_DEFAULTS.firstPollMs, pollMs);
  const fault = options.fault ?? (() => {});

  const settled = async (runId: string, outcome: Exclude<BatchLineOutcome, "left_out">) => {
    const deployment = await settleBatchRun(sql, runId, outcome);
    if (deployment !== undefined) options.onSettled?.(outcome, 1, deployment);
  };

  const release = (row: BatchRunRow) => releaseHold(options.budgets, row);

  const fail = async (row: BatchRunRow, reason: string) => {
    await release(row);
    const { run, ref } = runOf(row);
    await failRun(sql, ref, reason, { summary: run.summary });
    await settled(row.run_id, "failed");
  };

  // Back on its lane's low stream. A stop after the send sends it again on the next read: the online hook queues
  // a run once (see `batch_online.ts`).
  const sendOnline = async (row: BatchRunRow, answer?: OnlineRun["answer"]) => {
    const { run_id: runId, tenant, payload } = row;
    await release(row);
    await options.online!({ runId, tenant, payload, acceptedMs: row.accepted_ms ?? undefined, answer });
    await fault("online_sent", runId);
    await settled(runId, "online");
  };
  // A line the batch never finished: BATCH_ON_EXPIRY decides.
  const unfinished = async (row: BatchRunRow, why: string) => {
    if (options.onExpiry === "fail" || !options.online) return await fail(row, `BatchExpired: ${why}`);
    await sendOnline(row);
  };
  // A transient error line (429, 5xx) says nothing about the run: it goes online, as a retry would, whatever
  // BATCH_ON_EXPIRY says (that covers only lines an expired, cancelled or failed batch left unfinished).
  const transient = async (row: BatchRunRow, why: string) => {
    if (!options.online) return await fail(row, `UpstreamHttpError: ${why} (no online path to retry it)`);
    await sendOnline(row);
  };
  // A structured run's answer goes to a worker, which has the validators and makes the repair call if one is
  // needed, in its message.
  const toCheck = async (row: BatchRunRow, answer: OnlineRun["answer"]) => {
    if (!options.online) return await fail(row, "BatchAnswerUnchecked: no worker to check it against its schema");
    await sendOnline(row, answer);
  };

  const settleLine = async (batch: BatchRow, row: BatchRunRow, line: OutputLine) => {
    const status = line.response?.status_code;
    if (line.error && UNFINISHED_CODES.has(line.error.code ?? "") || status === undefined) {
      return await unfinished(row, line.error?.code ?? "no response");
    }
    const attempt = attemptOf(batch, row, line, options.prices);
    await insertBatchAttempt(sql, attempt);
    // After the row: a budget hash rebuilt from the record counts the line there, and is not charged again.
    if (options.budgets) await chargeLine(options.budgets, log, batch, row, attempt);
    if (status === 200) {
      const text = line.response?.body?.choices?.[0]?.message?.content?.trim();
      if (!text) return await fail(row, "EmptyCompletion: The model returned no text");
      if (structured(row)) return await toCheck(row, { text, model: batch.model });
      const { run, ref } = runOf(row);
      const result: JobResult = run.summary
        ? { ...ref, summary: text, notify: run.notify! }
        : { ...ref, input: run.input, output: text, model: batch.model };
      await committer.commit(result);
      return await settled(row.run_id, "committed");
    }
    if (status === 429 || status >= 500) return await transient(row, String(status));
    const message = line.response?.body?.error?.message ?? "";
    await fail(row, `UpstreamHttpError: ${status} ${message}`.trim());
  };

  const settle = async (batch: BatchRow, client: BatchClient, signal: AbortSignal) => {
    const rows = new Map((await batchRuns(sql, batch.id)).filter((r) => r.in_file).map((r) => [r.run_id, r]));
    const seen = new Set<string>();
    const lines = [...await readLines(client, batch.output_file_id), ...await readLines(client, batch.error_file_id)];
    for (const line of lines) {
      const row = rows.get(line.custom_id);
      // Not ours, or a custom_id the provider repeated: the first line of a run is its answer.
      if (!row || seen.has(row.run_id)) continue;
      seen.add(row.run_id);
      if (row.settled) continue;
      // Another process may have taken the batch: it settles the rest (each line is settled once either way).
      signal.throwIfAborted();
      await settleLine(batch, row, line);
      await fault("line_settled", row.run_id);
    }
    // Lines the provider reported nowhere (a batch that failed validation, or was cut short).
    for (const row of rows.values()) {
      if (seen.has(row.run_id) || row.settled) continue;
      signal.throwIfAborted();
      await unfinished(row, `batch ${batch.provider_status}`);
      await fault("line_settled", row.run_id);
    }
    await moveBatch(sql, batch.id, "ended", "committed");
    log.info("batch_committed", { batch_id: batch.id, lines: rows.size, provider_status: batch.provider_status });
  };

  const runOnce = async () => {
    for (let n = 0; n < POLLER_DEFAULTS.perPass; n++) {
      // Leased for the poll interval and not given back while it runs: the lease is the time to its next poll.
      const batch = await leaseBatch(sql, ["submitted"], { leaseMs: pollMs, shortestMs: firstPollMs });
      if (!batch) break;
      const client = clients.get(batch.deployment);
      if (!client) continue;
      await poll(sql, log, batch, client).catch((error) =>
        log.warn("batch_poll_failed", { batch_id: batch.id, error })
      );
    }
    let settled = 0;
    while (settled < POLLER_DEFAULTS.perPass) {
      const batch = await leaseBatch(sql, ["ended"], { leaseMs: options.leaseMs ?? POLLER_DEFAULTS.leaseMs });
      if (!batch) break;
      const client = clients.get(batch.deployment);
      if (!client) break;
      try {
        await whileLeased(
          sql,
          batch,
          options.leaseMs ?? POLLER_DEFAULTS.leaseMs,
          ({ signal }) => settle(batch, client, signal),
          () => log.warn("batch_lease_lost", { batch_id: batch.id, state: batch.state }),
        );
      } catch (error) {
        log.warn("batch_commit_failed", { batch_id: batch.id, error });
        throw error;
      }
      settled++;
    }
    return settled;
  };

  return {
    runOnce,
    run: (signal) => passEvery(options.intervalMs ?? POLLER_DEFAULTS.intervalMs, signal, runOnce),
  };
}
