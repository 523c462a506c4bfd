/**
 * The seam between a run and the deployments that serve its model calls. A run asks {@linkcode Models.acquire}
 * before every attempt (the first and each retry) and makes the call on what it was given, so each attempt may go
 * to another deployment; the worker asks {@linkcode Models.capacity} how many jobs to read. Two implementations,
 * built in `src/processes/_model.ts`: the single configured deployment (`src/provider/deployment.ts`), and the
 * router over `LLM_DEPLOYMENTS` (`src/provider/deployments.ts`).
 */
import type { Completion, LLM } from "./llm.ts";

/** How a call made under a permit ended. */
export interface CallOutcome {
  value?: Completion;
  error?: unknown;
  /** The caller gave up (a stop): says nothing about the provider. */
  aborted?: boolean;
  /** With `aborted`: the call never went out (stopped before it started). */
  notSent?: boolean;
}

/** The right to make one call on a deployment, settled with how the call ended. */
export interface ModelPermit {
  /** How long the caller waited for it, in ms (not charged to the job's deadline). */
  readonly waitedMs: number;
  /**
   * Reports the call's outcome to the deployment's flow control.
   * @returns whether flow control took the failure on itself (a 429, an outage): the caller waits and tries
   * again without counting an attempt.
   */
  settle(outcome: CallOutcome): Promise<boolean>;
}

/** One call's place: where it goes, under which permit, and the names it is recorded under. */
export interface Acquired {
  /** The client of the deployment that takes the call. */
  llm: LLM;
  /** Settled with the call's outcome; none for a deployment without flow control (the local model). */
  permit?: ModelPermit;
  /**
   * The model asked for: one of those the call accepts (the caller names it to `llm`), or, when it accepts any,
   * the deployment's default, which `llm` asks for unless told otherwise.
   */
  model: string;
  /** The deployment that takes the call, as `model_attempts.deployment` records it. */
  deployment: string;
}

/** Who a call is for: flow control tells one job's failures from the provider's by them. */
export interface AcquireOptions {
  /** Aborts the wait for a permit. */
  signal?: AbortSignal;
  jobId?: string;
  tenant?: string;
}

/** What the worker may read now: jobs whose calls can start within about a second, or when to ask again. */
export interface Capacity {
  permits: number;
  waitMs: number;
}

/** The deployments a worker's model calls go to. */
export interface Models {
  /** The model a call that accepts any is asked of, as runs cache and record it. */
  readonly defaultModel: string;
  /**
   * Waits until a call of `estimate` tokens may go out, and says where: a deployment serving one of `models`
   * (the names the call accepts, in order of preference; empty: any), with its permit.
   * @throws the signal's reason when it aborts while waiting; `GateRefused` when the call can never go.
   */
  acquire(models: readonly string[], estimate: number, options?: AcquireOptions): Promise<Acquired>;
  /**
   * The worker's read gate: how many jobs of about `averageTokens` each may be read now. Absent when reads are
   * bounded by the worker's slots alone (no deployment has flow control).
   */
  capacity?(averageTokens: number): Promise<Capacity>;
}
