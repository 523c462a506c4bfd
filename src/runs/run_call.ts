/**
 * A run's model call: each attempt takes its deployment and permit from `models.acquire`, then its tenant's
 * budget reservation, and is made on the deployment it was given, under the job's deadline and retry policy;
 * each attempt is recorded.
 */
import type { Completion } from "../llm/llm.ts";
import { MAX_OUTPUT_TOKENS } from "../llm/llm.ts";
import type { Acquired } from "../llm/models.ts";
import type { Logger } from "../log/logger.ts";
import { JobDeferred, PermanentJobError } from "../queue/errors.ts";
import { BudgetExhausted, type HeldReservation, worstCaseTokens } from "../budgets/budgets.ts";
import { type CallEnd, type CallTokens, chargeOf } from "../budgets/charge.ts";
import { isRetryable } from "../retry/classify.ts";
import type { Deadline } from "../retry/deadline.ts";
import { DeadlineExceeded, GateUnavailable } from "../retry/errors.ts";
import { type AttemptDetails, type AttemptGate, type AttemptReport, callWithRetries } from "../retry/retry_policy.ts";
import type { Outcome } from "../jobs/job_store.ts";
import { recordSpan } from "../tracing.ts";
import { attemptCharge, attemptCost, attemptRow } from "./attempt_log.ts";
import type { Committed } from "./commit.ts";
import type { Delivery, Job, ModelCall } from "./run_deps.ts";
import { endedBy } from "./run_decided.ts";
import { beforeExpiry, expire, goingOut, hasExpired, RunExpired, throwIfExpired, untilExpiry } from "./run_expiry.ts";

/** What a model call answered, and the model that answered it. */
export interface Answered {
  text: string;
  model: string;
}

/** The job was decided (cancelled, or done or failed by another delivery) while it ran: no more model calls. */
class JobDecided extends Error {
  constructor(jobId: string, readonly outcome: Outcome) {
    super(`job ${jobId} was ${outcome} meanwhile`);
    this.name = "JobDecided";
  }
}

/** The between-attempts check of the job's outcome failed (Postgres did not answer): transient, never permanent. */
class DecidedCheckFailed extends Error {
  constructor(jobId: string, options: ErrorOptions) {
    super(`the outcome of job ${jobId} could not be read between attempts`, options);
    this.name = "DecidedCheckFailed";
  }
}

const NO_TOKENS: CallTokens = { prompt: 0, completion: 0 };

/**
 * An attempt's tokens, request id and model from the completion, or its error's class and request id; and what
 * it is charged on (`chargeOf`'s rule, read while the error is at hand).
 */
function describeAttempt({ value, error }: { value?: Completion; error?: unknown }): AttemptDetails {
  const charge = chargeOf({ value, error }, NO_TOKENS).basis;
  if (value) {
    return {
      prompt_tokens: value.usage?.prompt_tokens,
      completion_tokens: value.usage?.completion_tokens,
      request_id: value.requestId,
      model: value.model,
      charge,
    };
  }
  const headers = (error as { headers?: unknown })?.headers;
  return {
    error_class: error instanceof Error ? error.name : "Error",
    request_id: headers instanceof Headers ? headers.get("x-request-id") ?? undefined : undefined,
    charge,
  };
}

/**
 * The model call, with retries under the job's deadline and the permits of the deployments it is given (the
 * first one asked for already, as `first.pending`, which the first attempt takes and clears).
 * @returns the answer, or how the delivery ended when the job was decided meanwhile, or expired before its first
 * attempt could go out.
 * @throws {JobDeferred} when the tenant's budget refused the call (the run goes back to its lane).
 * @throws {PermanentJobError} for a model error no retry can fix.
 * @throws the retryable error, `DeadlineExceeded` or `GateUnavailable`, to leave the message pending.
 */
export async function callModel(
  job: Job,
  delivery: Delivery,
  { call, estimated, first, signal, deadline }: {
    call: ModelCall;
    estimated: number;
    deadline: Deadline;
    first: { pending?: Promise<Acquired> };
    signal: AbortSignal;
  },
): Promise<Answered | { skipped: Committed }> {
  const { options } = job;
  const { job_id } = delivery;
  // The attempt being made: its deployment and model name its record (attempts are made one after another).
  const served: { current?: Acquired } = {};
  try {
    const completion = await callWithRetries(
      // A call that accepts any model asks the deployment's default, which its client knows.
      (s, { llm, model }) =>
        llm.complete(call.prompt, { ...call.options, ...(call.models.length ? { model } : {}), signal: s }),
      {
        gate: attemptGate(job, delivery, { call, estimated, first, served }),
        deadline,
        perCallTimeoutMs: options.perCallTimeoutMs,
        maxAttempts: options.maxAttempts,
        baseMs: options.backoffBaseMs,
        capMs: options.backoffCapMs,
        clock: options.clock,
        random: options.random,
        signal,
        describe: describeAttempt,
        // A cancel (or another delivery's commit or dead letter) during an attempt stops the job before its next
        // call. A check Postgres cannot answer (a failover, a terminated connection) is transient, not the model's
        // verdict.
        beforeRetry: async () => {
          const now = await job.decided(job_id).catch((cause) => {
            throw new DecidedCheckFailed(job_id, { cause });
          });
          if (now) throw new JobDecided(job_id, now);
        },
        onAttempt: (report) => recordAttempt(job, delivery, report, { call, served: served.current }),
      },
    );
    return { text: completion.text, model: served.current!.model };
  } catch (error) {
    if (error instanceof JobDecided) return { skipped: endedBy(delivery, error.outcome, "between_attempts") };
    // The run reached its expiry before any attempt of it went out (once one has, none is held to it), and none
    // holds a reservation: the run ends expired, with no model call.
    if (error instanceof RunExpired) return { skipped: await expire(job, delivery, "permit") };
    if (error instanceof BudgetExhausted) {
      // Back to the end of its lane, no delivery spent; the lane is not read until the budget fits again.
      job.budgetExhausted?.(error);
      delivery.log.info("run_waiting_for_budget", { budget: error.budget, retry_after_s: error.retryAfterS });
      throw new JobDeferred(error.message, { cause: error });
    }
    // Postgres's error, left to leave the message pending: without this it read as a permanent model error.
    if (error instanceof DecidedCheckFailed) throw error.cause;
    // Transient: leave the message pending; redelivery brings a fresh budget.
    if (signal.aborted || error instanceof DeadlineExceeded || error instanceof GateUnavailable) throw error;
    if (isRetryable(error)) throw error;
    const name = error instanceof Error ? (error.name === "Error" ? error.constructor.name : error.name) : "Error";
    throw new PermanentJobError(`${name}: ${error instanceof Error ? error.message : String(error)}`, {
      cause: error,
    });
  }
}

/**
 * Each attempt's grant: the deployment and permit `models.acquire` gives it (the first one asked for already),
 * then the tenant's budget reservation for the model it was given, settled with the permit.
 */
function attemptGate(
  job: Job,
  delivery: Delivery,
  { call, estimated, first, served }: {
    call: ModelCall;
    estimated: number;
    first: { pending?: Promise<Acquired> };
    served: { current?: Acquired };
  },
): AttemptGate<Completion, Acquired> {
  const { job_id, tenant } = delivery;
  const clock = job.options.clock;
  return {
    acquire: async (signal) => {
      // A run's first attempt starts only before its expiry (once one went out, `hasExpired` is false for good).
      // Checked before the first permit is taken: a pending one stays in `first` and the run job gives it back.
      throwIfExpired(delivery, clock);
      const { pending } = first;
      first.pending = undefined;
      let acquired: Acquired;
      if (pending) acquired = await pending;
      else {
        // The wait for a permit ends at the run's expiry (RunExpired).
        const bounded = untilExpiry(delivery, signal ?? new AbortController().signal, clock);
        try {
          const acquiring = job.models.acquire(call.models, estimated, {
            signal: bounded.signal,
            jobId: job_id,
            tenant,
          });
          acquired = await beforeExpiry(acquiring, bounded);
        } finally {
          bounded.done();
        }
      }
      const { permit } = acquired;
      if (hasExpired(delivery, clock)) {
        // Granted at the moment of the expiry: the permit goes back unsent, and no budget is reserved.
        await permit?.settle({ aborted: true, notSent: true }).catch(() => {});
        throw new RunExpired(job_id, delivery.run.expiresAt!);
      }
      served.current = acquired;
      // The budget once the call may go: a reservation is held only while its call runs (not through a wait
      // for the provider), so one that is never settled (its worker killed) is a call that may have been billed.
      let held: HeldReservation | undefined;
      try {
        held = await job.budgets?.reserve(tenant, acquired.model, worstCaseOf(call));
      } catch (error) {
        // Refused (or the budget unreadable): the permit goes back unused.
        await permit?.settle({ aborted: true }).catch(() => {});
        throw error;
      }
      try {
        // A run with an expiry is let start by its record before its first attempt goes out (decided once for
        // every delivery: a redelivery will not expire it), unless it was decided expired first.
        await goingOut(job, delivery, clock);
      } catch (error) {
        // Expired, or no decision written: both go back unsent and uncharged; the call does not go out.
        await Promise.all([
          permit?.settle({ aborted: true, notSent: true }).catch(() => {}),
          held && settleBudget(held, { notSent: true }, delivery.log),
        ]);
        throw error;
      }
      if (!held) return acquired;
      const reserved = held;
      return {
        ...acquired,
        permit: {
          waitedMs: permit?.waitedMs ?? 0,
          settle: async (outcome) => {
            // A call aborted while it ran (a stop) may have been billed: charged its reservation.
            // One stopped before it went out costs nothing.
            const end = outcome.notSent
              ? { notSent: true }
              : outcome.aborted
              ? { error: new Error("aborted while in flight") }
              : outcome;
            const [absorbed] = await Promise.all([
              permit ? permit.settle(outcome) : false,
              settleBudget(reserved, end, delivery.log),
            ]);
            return absorbed;
          },
        },
      };
    },
  };
}

/**
 * Settles a call's reservation, trying again twice over a second when Redis refuses: one left unsettled is held
 * as in flight for up to 30 minutes, then charged whole (see `RESERVATION_EPOCH_MS` in `budgets/budget_hash.ts`).
 */
async function settleBudget(held: HeldReservation, end: CallEnd, log: Logger): Promise<void> {
  for (let attempt = 1;; attempt++) {
    try {
      return await held.settle(end);
    } catch (error) {
      if (attempt >= 3) return log.warn("budget_settle_failed", { error });
      await new Promise((resolve) => setTimeout(resolve, 250 * attempt));
    }
  }
}

/** A call's worst case for the budgets: every message it sends and every output token it may write. */
export function worstCaseOf({ prompt, options }: ModelCall): CallTokens {
  const messages = [prompt, ...(options.system === undefined ? [] : [options.system])];
  for (const turn of options.followUp ?? []) messages.push(turn.content);
  // A structured-output call sends its schema too (response_format), which the provider counts as prompt tokens.
  if (options.jsonSchema) messages.push(options.jsonSchema.name + JSON.stringify(options.jsonSchema.schema));
  return worstCaseTokens(messages, options.maxOutputTokens ?? MAX_OUTPUT_TOKENS);
}

/**
 * One attempt's span, log line and `model_attempts` row (with its cost, see {@linkcode attemptCost}), under the
 * model and deployment the attempt was given.
 */
function recordAttempt(
  job: Job,
  delivery: Delivery,
  report: AttemptReport,
  { call, served }: { call: ModelCall; served: Acquired | undefined },
): void {
  const { job_id, tenant, message, log, run } = delivery;
  if (report.started_at_ms !== undefined) {
    recordSpan("model.attempt", {
      startMs: report.started_at_ms,
      endMs: report.started_at_ms + report.duration_ms,
      failed: report.outcome !== "ok",
      attributes: {
        attempt: report.attempt,
        outcome: report.outcome,
        "http.response.status_code": report.status,
        "permit.wait_ms": report.permit_wait_ms,
        "retry.wait_ms": report.wait_ms,
        "gen_ai.usage.input_tokens": report.details?.prompt_tokens,
        "gen_ai.usage.output_tokens": report.details?.completion_tokens,
        "gen_ai.response.model": report.details?.model,
        // The model and deployment the router gave this attempt (a fallback's, when it fell back).
        "gen_ai.request.model": served?.model,
        "oncely.deployment": served?.deployment,
      },
    });
  }
  const { details, ...logged } = report;
  log[report.outcome === "ok" ? "debug" : "info"]("model_attempt", { ...logged, ...details });
  delivery.usage.prompt += details?.prompt_tokens ?? 0;
  delivery.usage.completion += details?.completion_tokens ?? 0;
  job.options.onAttempt?.({ ...report, job_id });
  // An attempt that started was given its deployment; one that did not (a spent budget, a deadline) has no row.
  if (report.started_at_ms === undefined || !served) return;
  const { model, deployment } = served;
  // Numbered across the delivery's calls (a repair call's first attempt follows the first call's last), so each
  // row of `model_attempts` names one call.
  const row = attemptRow({ ...report, attempt: ++delivery.recorded }, {
    job_id,
    tenant,
    delivery: message.deliveries,
    model,
    task: run.task,
    version: run.version,
    deployment,
    cost_usd: attemptCost(report.details, worstCaseOf(call), job.prices?.of(model)),
    charged_tokens: attemptCharge(report.details, worstCaseOf(call)),
  });
  if (row) job.attempts?.record(row);
}
