import { isRetryable, reasonOf, retryAfterMs } from "./classify.ts";
import { linkedSignal } from "../async/linked_signal.ts";
import type { Clock } from "./clock.ts";
import { systemClock } from "./clock.ts";
import type { Deadline } from "./deadline.ts";
import { AttemptTimeout, DeadlineExceeded, GateRefused, GateUnavailable } from "./errors.ts";

/** What one attempt reports, for logs and metrics. */
export interface AttemptReport {
  attempt: number;
  /**
   * `paused`: the gate took the failure on itself (a 429, an outage); the attempt does not count. `aborted`: the
   * caller's signal stopped the call while it ran (the worker stopping past its grace): it may have been billed.
   */
  outcome: "ok" | "retry" | "give_up" | "deadline" | "paused" | "aborted";
  reason?: string;
  status?: number;
  /** The wait before the next attempt, in ms. */
  wait_ms?: number;
  remaining_ms: number;
  duration_ms: number;
  /** Time spent waiting for the gate's permit before this attempt, in ms. */
  permit_wait_ms?: number;
  /** When the call started (epoch ms); absent for an attempt never started. */
  started_at_ms?: number;
  /** What `describe` read from the attempt's value or error (tokens, request id, model, error class). */
  details?: AttemptDetails;
}

/** What an attempt's result says about it, for the record of model attempts. */
export interface AttemptDetails {
  prompt_tokens?: number;
  completion_tokens?: number;
  request_id?: string;
  model?: string;
  error_class?: string;
  /**
   * What the call is charged on: the usage the provider `reported`, the `reserved` worst case of a call that
   * may have run without reporting any (a timeout after it was sent), or `none` (refused, never sent).
   */
  charge?: "reported" | "reserved" | "none";
}

/** The right to make one attempt, settled with how it ended. */
export interface AttemptPermit<T> {
  readonly waitedMs: number;
  /**
   * `notSent`: with `aborted`, the call never went out (stopped before it started).
   * @returns true when the gate absorbed the failure: retry after its wait, without counting an attempt.
   */
  settle(outcome: { value?: T; error?: unknown; aborted?: boolean; notSent?: boolean }): Promise<boolean>;
}

/** What the gate grants one attempt: its permit, if flow control applies, and whatever the call is made with. */
export interface Granted<T> {
  readonly permit?: AttemptPermit<T>;
}

/**
 * Shared flow control in front of every attempt (the provider limiter and
 * breaker). Each attempt first takes a grant, which the call receives (so
 * the gate may choose where the call goes), then its permit is settled with
 * how the attempt ended.
 */
export interface AttemptGate<T, G extends Granted<T> = Granted<T>> {
  acquire(signal?: AbortSignal): Promise<G>;
}

/** Options for {@linkcode callWithRetries}. */
export interface RetryOptions<T = unknown, G extends Granted<T> = Granted<T>> {
  deadline: Deadline;
  /** Wall-clock cap of one attempt. */
  perCallTimeoutMs: number;
  maxAttempts: number;
  /** Full-jitter base: attempt n waits up to `min(capMs, baseMs * 2^n)`. */
  baseMs?: number;
  /** Longest wait between attempts, also the cap on a provider's Retry-After. */
  capMs?: number;
  /** An attempt with less time than this is not worth starting. Capped at `perCallTimeoutMs`. */
  minAttemptMs?: number;
  clock?: Clock;
  /** Uniform random in [0, 1). */
  random?: () => number;
  /** Aborts the whole call (shutdown); not retried. */
  signal?: AbortSignal;
  onAttempt?: (report: AttemptReport) => void;
  /**
   * Runs before every attempt but the first; what it throws ends the call
   * as is (a job cancelled meanwhile must not call again).
   */
  beforeRetry?: () => Promise<void>;
  /** Reads an attempt's details (tokens, request id) from its value or error, for `onAttempt`. */
  describe?: (outcome: { value?: T; error?: unknown }) => AttemptDetails;
  /** Flow control shared with other callers; its waits are not charged to `deadline`. */
  gate?: AttemptGate<T, G>;
}

/** Defaults of {@linkcode RetryOptions}, in one place. */
export const RETRY_DEFAULTS = {
  /** Full-jitter base: attempt n waits up to `min(capMs, baseMs * 2^n)`. */
  baseMs: 500,
  /** The longest wait between attempts, also the cap on a provider's Retry-After. */
  capMs: 8_000,
  /** An attempt with less time than this is not worth starting. */
  minAttemptMs: 1_000,
} as const;

/**
 * Full-jitter backoff: a uniform wait in `[0, min(cap, base * 2^attempt))`.
 * A provider's Retry-After wins when present, capped.
 */
export function backoffMs(
  attempt: number,
  error: unknown,
  { baseMs, capMs, random, epochNow }: { baseMs: number; capMs: number; random: () => number; epochNow: number },
): number {
  const asked = retryAfterMs(error, epochNow);
  if (asked !== undefined) return Math.min(asked, capMs);
  return random() * Math.min(capMs, baseMs * 2 ** attempt);
}

/**
 * Calls `fn` until it succeeds, retrying only what {@linkcode isRetryable}
 * says a later attempt can fix. Every attempt gets
 * `min(perCallTimeoutMs, deadline.remaining())`, enforced by racing a
 * wall-clock timer as well as aborting `fn`'s signal: a server that drips a
 * byte every few seconds never trips an HTTP read timeout. With a `gate`,
 * every attempt (the first and each retry) waits for its grant first and
 * `fn` is called with it, and a failure the gate absorbs is retried after the
 * gate's wait without counting toward `maxAttempts`.
 * @throws {DeadlineExceeded} when the budget cannot fit another useful attempt
 * (its `cause` is the last error).
 * @throws {GateUnavailable} when the gate cannot be asked.
 * @throws the last error when it is not retryable or attempts are exhausted.
 */
export function callWithRetries<T>(
  fn: (signal: AbortSignal) => Promise<T>,
  options: RetryOptions<T> & { gate?: undefined },
): Promise<T>;
export function callWithRetries<T, G extends Granted<T>>(
  fn: (signal: AbortSignal, granted: G) => Promise<T>,
  options: RetryOptions<T, G> & { gate: AttemptGate<T, G> },
): Promise<T>;
export async function callWithRetries<T, G extends Granted<T>>(
  fn: (signal: AbortSignal, granted: G) => Promise<T>,
  options: RetryOptions<T, G>,
): Promise<T> {
  const clock = options.clock ?? systemClock;
  const random = options.random ?? Math.random;
  const baseMs = options.baseMs ?? RETRY_DEFAULTS.baseMs;
  const capMs = options.capMs ?? RETRY_DEFAULTS.capMs;
  const minAttemptMs = Math.min(options.minAttemptMs ?? RETRY_DEFAULTS.minAttemptMs, options.perCallTimeoutMs);
  const { deadline, onAttempt } = options;

  let lastError: unknown;
  for (let attempt = 1, first = true;; attempt++, first = false) {
    options.signal?.throwIfAborted();
    if (!first) await options.beforeRetry?.();
    if (deadline.remaining() < minAttemptMs) {
      onAttempt?.({ attempt, outcome: "deadline", remaining_ms: deadline.remaining(), duration_ms: 0 });
      throw new DeadlineExceeded(`${Math.round(deadline.remaining())} ms of budget left, need ${minAttemptMs}`, {
        cause: lastError,
      });
    }
    // Waiting for the shared permit costs the job nothing: the provider, not the job, is the bottleneck.
    const granted = await options.gate?.acquire(options.signal).catch((cause) => {
      if (options.signal?.aborted || cause instanceof GateRefused) throw cause;
      throw new GateUnavailable(`flow control unavailable: ${cause instanceof Error ? cause.message : cause}`, {
        cause,
      });
    });
    const permit = granted?.permit;
    if (permit) deadline.extend(permit.waitedMs);
    // Stopped while the permit (or a budget's reservation) was being granted: the call never goes out, so there
    // is no attempt to record and nothing to charge.
    if (options.signal?.aborted) {
      await permit?.settle({ aborted: true, notSent: true }).catch(() => {});
      throw options.signal.reason;
    }
    const budget = Math.min(options.perCallTimeoutMs, deadline.remaining());
    const started = clock.now();
    const started_at_ms = clock.epochNow();
    const timer = clock.timer(budget);
    let onTimeout!: () => void;
    const timedOut = new Promise<never>((_, reject) => {
      onTimeout = () => reject(new AttemptTimeout(`attempt ${attempt} exceeded ${Math.round(budget)} ms`));
      timer.signal.addEventListener("abort", onTimeout, { once: true });
    });
    // Linked for this attempt only: the stop signal outlives every call (see linkedSignal). After onTimeout, so
    // a timeout rejects timedOut before the call hears of it: the attempt fails as an AttemptTimeout.
    const linked = options.signal ? linkedSignal(timer.signal, options.signal) : undefined;
    const signal = linked?.signal ?? timer.signal;
    let result: T;
    try {
      // Without a gate, `fn` takes the signal alone (the first overload).
      result = await Promise.race([fn(signal, granted as G), timedOut]);
    } catch (error) {
      lastError = error;
      timer.cancel();
      timer.signal.removeEventListener("abort", onTimeout);
      linked?.unlink();
      const duration_ms = clock.now() - started;
      const reason = reasonOf(lastError);
      const status = (lastError as { status?: unknown })?.status;
      const report = {
        attempt,
        reason,
        status: typeof status === "number" ? status : undefined,
        duration_ms,
        permit_wait_ms: permit?.waitedMs,
        started_at_ms,
        details: options.describe?.({ error }),
      };
      if (options.signal?.aborted) {
        // Still one call made: its record says so, though nothing follows it. Reported before the settlement,
        // which may wait on Redis while the stop's last moments run out.
        onAttempt?.({ ...report, outcome: "aborted", remaining_ms: deadline.remaining() });
        await permit?.settle({ aborted: true }).catch(() => {});
        throw options.signal.reason;
      }
      // The gate settles first, so the pause or the open breaker is in force before anyone's next attempt.
      // An absorbed failure was the provider's, not the job's: it costs neither an attempt nor budget.
      if (permit && await settleOrThrow(permit, error)) {
        deadline.extend(duration_ms);
        onAttempt?.({ ...report, outcome: "paused", remaining_ms: deadline.remaining() });
        attempt--;
        continue;
      }
      await retryOrThrow(report);
      continue;
    }
    timer.cancel();
    timer.signal.removeEventListener("abort", onTimeout);
    linked?.unlink();
    await permit?.settle({ value: result }).catch(() => {});
    onAttempt?.({
      attempt,
      outcome: "ok",
      remaining_ms: deadline.remaining(),
      duration_ms: clock.now() - started,
      permit_wait_ms: permit?.waitedMs,
      started_at_ms,
      details: options.describe?.({ value: result }),
    });
    return result;
  }

  async function settleOrThrow(
    permit: { settle(outcome: { error: unknown }): Promise<boolean> },
    error: unknown,
  ): Promise<boolean> {
    try {
      return await permit.settle({ error });
    } catch (cause) {
      // Without the gate's verdict a quota error would look permanent: leave the job for redelivery instead.
      throw new GateUnavailable(`flow control unavailable: ${cause instanceof Error ? cause.message : cause}`, {
        cause,
      });
    }
  }

  async function retryOrThrow(
    report: Omit<AttemptReport, "outcome" | "remaining_ms">,
  ): Promise<void> {
    const { attempt } = report;
    if (!isRetryable(lastError) || attempt >= options.maxAttempts) {
      onAttempt?.({ ...report, outcome: "give_up", remaining_ms: deadline.remaining() });
      throw lastError;
    }
    const wait = backoffMs(attempt, lastError, { baseMs, capMs, random, epochNow: clock.epochNow() });
    // Stop before a sleep that would leave less than one useful attempt.
    if (deadline.remaining() - wait < minAttemptMs) {
      onAttempt?.({ ...report, outcome: "deadline", wait_ms: wait, remaining_ms: deadline.remaining() });
      throw new DeadlineExceeded(
        `waiting ${Math.round(wait)} ms would leave less than ${minAttemptMs} ms of budget`,
        { cause: lastError },
      );
    }
    onAttempt?.({ ...report, outcome: "retry", wait_ms: wait, remaining_ms: deadline.remaining() });
    await clock.sleep(wait, options.signal);
  }
}
