import { isRetryable, reasonOf, retryAfterMs } from "./classify.ts";
import type { Clock } from "./clock.ts";
import { systemClock } from "./clock.ts";
import type { Deadline } from "./deadline.ts";
import { AttemptTimeout, DeadlineExceeded } from "./errors.ts";

/** What one attempt reports, for logs and metrics. */
export interface AttemptReport {
  attempt: number;
  outcome: "ok" | "retry" | "give_up" | "deadline";
  reason?: string;
  status?: number;
  /** The wait before the next attempt, in ms. */
  wait_ms?: number;
  remaining_ms: number;
  duration_ms: number;
}

/** Options for {@linkcode callWithRetries}. */
export interface RetryOptions {
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
}

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
 * byte every few seconds never trips an HTTP read timeout.
 * @throws {DeadlineExceeded} when the budget cannot fit another useful attempt
 * (its `cause` is the last error).
 * @throws the last error when it is not retryable or attempts are exhausted.
 */
export async function callWithRetries<T>(fn: (signal: AbortSignal) => Promise<T>, options: RetryOptions): Promise<T> {
  const clock = options.clock ?? systemClock;
  const random = options.random ?? Math.random;
  const baseMs = options.baseMs ?? 500;
  const capMs = options.capMs ?? 8_000;
  const minAttemptMs = Math.min(options.minAttemptMs ?? 1_000, options.perCallTimeoutMs);
  const { deadline, onAttempt } = options;

  let lastError: unknown;
  for (let attempt = 1;; attempt++) {
    options.signal?.throwIfAborted();
    const budget = Math.min(options.perCallTimeoutMs, deadline.remaining());
    if (budget < minAttemptMs) {
      onAttempt?.({ attempt, outcome: "deadline", remaining_ms: deadline.remaining(), duration_ms: 0 });
      throw new DeadlineExceeded(`${Math.round(deadline.remaining())} ms of budget left, need ${minAttemptMs}`, {
        cause: lastError,
      });
    }
    const started = clock.now();
    const timer = clock.timer(budget);
    const signal = options.signal ? AbortSignal.any([timer.signal, options.signal]) : timer.signal;
    let onTimeout!: () => void;
    const timedOut = new Promise<never>((_, reject) => {
      onTimeout = () => reject(new AttemptTimeout(`attempt ${attempt} exceeded ${Math.round(budget)} ms`));
      timer.signal.addEventListener("abort", onTimeout, { once: true });
    });
    try {
      const result = await Promise.race([fn(signal), timedOut]);
      onAttempt?.({ attempt, outcome: "ok", remaining_ms: deadline.remaining(), duration_ms: clock.now() - started });
      return result;
    } catch (error) {
      lastError = error;
    } finally {
      timer.cancel();
      timer.signal.removeEventListener("abort", onTimeout);
    }

    const duration_ms = clock.now() - started;
    const reason = reasonOf(lastError);
    const status = (lastError as { status?: unknown })?.status;
    const report = { attempt, reason, status: typeof status === "number" ? status : undefined, duration_ms };
    if (options.signal?.aborted) throw options.signal.reason;
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
