/**
 * What the run job's modules share: its dependencies and options, one delivery, and one model call. The job is
 * `run_job.ts` (the orchestrator); it loads and renders (`run_load.ts`), asks whether the job was decided
 * elsewhere (`run_decided.ts`), calls the model (`run_call.ts`), checks and repairs a structured answer
 * (`run_check.ts`) and commits (`run_commit.ts`).
 */
import type { Sql } from "postgres";
import type { CallOptions } from "../llm/llm.ts";
import type { Models } from "../llm/models.ts";
import type { Logger } from "../log/logger.ts";
import type { BudgetExhausted, Budgets } from "../budgets/budgets.ts";
import type { StreamMessage } from "../queue/message.ts";
import type { Clock } from "../retry/clock.ts";
import type { AttemptReport } from "../retry/retry_policy.ts";
import type { AttemptLog } from "./attempt_log.ts";
import type { Prices } from "../llm/prices.ts";
import type { Outcome } from "../jobs/job_store.ts";
import type { GroupCommitter } from "./commit.ts";
import type { RunJob } from "./run_payload.ts";
import type { TaskCache } from "../tasks/task_cache.ts";
import type { SchemaValidators } from "../tasks/validator.ts";
import type { ResultCache, RunCache } from "../cache/result_cache.ts";

/** Options for `createSummaryJob`. */
export interface SummaryJobOptions {
  /** Budget of one delivery across attempts and sleeps (JOB_BUDGET_S). */
  budgetMs: number;
  perCallTimeoutMs: number;
  maxAttempts: number;
  clock?: Clock;
  random?: () => number;
  backoffBaseMs?: number;
  backoffCapMs?: number;
  onAttempt?: (report: AttemptReport & { job_id: string }) => void;
}

/** What `createSummaryJob` needs. */
export interface SummaryJobDeps {
  sql: Sql;
  /** Where each model call goes: every attempt takes its deployment and its permit from `models.acquire`. */
  models: Models;
  log: Logger;
  committer: GroupCommitter;
  /** The record of model attempts (`model_attempts`); none when unset. */
  attempts?: AttemptLog;
  /** Task versions (runs of tasks other than summarize); without it, only summary jobs run. */
  tasks?: TaskCache;
  /**
   * Validates a model's answer against a task's output schema, compiled once per `key`; the schema is compiled
   * (`prepare`) before the model is called.
   */
  validators?: Pick<SchemaValidators, "validate" | "prepare">;
  /** Tenant budgets: every call's worst case is reserved before it and settled after it. */
  budgets?: Budgets;
  /** A run's budget is spent: told before the run is deferred, so its tenant's lane is not read meanwhile. */
  budgetExhausted?: (error: BudgetExhausted) => void;
  /** Model prices (LLM_PRICES): each attempt's `cost_usd`; without them, or for a model without one, NULL. */
  prices?: Prices;
  /** The result cache; without it, every run calls the model. */
  cache?: ResultCache;
  /**
   * The status its Redis record gives a job (`queued`, `cancelled`, ...), asked only of a message older than
   * `RECORD_CHECK_AFTER_MS` that Postgres finds undecided: retention may have deleted the outcome of a job
   * cancelled while it waited that long, and the record, which lives as long as the message waits, still says.
   */
  recordStatus?: (jobId: string, tenant: string) => Promise<string | undefined>;
  /** The Batch API (issue 43, `src/batches/`): runs with priority `batch` it takes are recorded into a batch. */
  batches?: BatchIntake;
  /**
   * Where a run with an expiry decides, once and for every delivery, whether its model call started or it expired
   * (its job's status record): a run whose first attempt was let go out, even in a delivery whose worker died
   * mid-call, does not expire, and one decided expired sends nothing (`run_expiry.ts`). Without it, only the
   * delivery that sent an attempt knows.
   */
  starts?: AttemptStarts;
}

/** The start decisions of runs with an expiry (see {@linkcode SummaryJobDeps.starts}). */
export interface AttemptStarts {
  /**
   * Decides (or reads the decision made first): `start` just before the run's first attempt goes out, `expire`
   * before it is decided expired. Resolves once the decision is written (and replicated, under
   * REDIS_MIN_REPLICAS_ACK): `expired`, or when the run was let start.
   */
  decide(jobId: string, tenant: string, mode: "start" | "expire", expiresAtMs: number): Promise<number | "expired">;
  /** The decision made so far, if any. */
  read(jobId: string, tenant: string): Promise<number | "expired" | undefined>;
}

/**
 * Where runs with priority `batch` go when a deployment of their model offers the Batch API (implemented in
 * `src/batches/batch_intake.ts`; declared here so that this folder does not import that one).
 */
export interface BatchIntake {
  /** The batch deployment and model a run accepting `models` (empty: the default) goes to; undefined: none. */
  target(models: readonly string[]): { deployment: string; model: string } | undefined;
  /** Whether the run is recorded in a batch already (by an earlier delivery): its line holds what it holds. */
  recorded(runId: string): Promise<boolean>;
  /**
   * Records the run into its target's open batch, in Postgres. Resolves only once it is recorded (the message
   * is acknowledged after that); a run recorded by an earlier delivery is not recorded again.
   * @returns "recorded", or "already" when an earlier delivery recorded it.
   */
  record(run: {
    runId: string;
    tenant: string;
    payload: string;
    acceptedMs?: number;
    call: ModelCall;
    target: { deployment: string; model: string };
    /** What its line holds against the tenant's budgets (`Budgets.hold`), recorded with it; none without a budget. */
    held?: { tokens: number; nanos: number };
  }): Promise<"recorded" | "already">;
}

/** What one summary job's deliveries share. */
export interface Job extends SummaryJobDeps {
  options: SummaryJobOptions;
  decided: (jobId: string) => Promise<Outcome | undefined>;
  /** Pre-checks made when messages were read ahead (`prepare`), by message, until their deliveries take them. */
  prepared: Map<string, Promise<Outcome | undefined>>;
}

/** One delivery's job, read from its message. */
export interface Delivery {
  message: StreamMessage;
  job_id: string;
  tenant: string;
  run: RunJob;
  log: Logger;
  /** Attempts recorded so far: a repair call's attempts continue the first call's numbering. */
  recorded: number;
  /** The tokens this delivery's model calls used, as reported: what its result costs (a cache entry's). */
  usage: { prompt: number; completion: number };
  /** The result cache as this run sees it, when it is on for the run: a done result fills it. */
  cache?: RunCache;
  /** Tells the worker that only the commit is left. */
  finishing?: () => void;
  /**
   * The run's model call started (its first attempt was let go out), in this delivery or an earlier one: its
   * expiry no longer applies. Read at the delivery's start for a run with an expiry, set before its first attempt.
   */
  started?: boolean;
  /** The run was decided expired before its call started (in an earlier delivery, or a concurrent one). */
  decidedExpired?: boolean;
  /** This delivery has its start decision written (and replicated): its attempts may go out. */
  decided?: boolean;
}

/** One model call of a run: the user message, how to ask, and the models it accepts. */
export interface ModelCall {
  prompt: string;
  /** Everything but the signal and the model, which the attempt's deployment names. */
  options: Omit<CallOptions, "signal" | "model">;
  /** The models the task accepts, in order of preference; empty: the deployment's default. */
  models: readonly string[];
}
