/** The client's retry policy: which answers are worth another try, and how long to wait first. */

/** What the policy needs to know about a request and its settings. */
export interface RetryPolicy {
  /** Backoff's first step, doubled on each retry. */
  baseMs: number;
  /** Backoff never waits longer than this. */
  capMs: number;
  /** A `Retry-After` longer than this is not waited out: the error goes to the caller. */
  maxRetryAfterMs: number;
  /** In [0, 1). */
  random: () => number;
  /** Epoch milliseconds, for a `Retry-After` given as an HTTP date. */
  now: () => number;
}

/**
 * `Retry-After` in milliseconds from `nowMs`: delay-seconds or an HTTP date
 * (RFC 9110 §10.2.3); undefined when absent or unreadable.
 */
export function retryAfterMs(value: string | null, nowMs: number): number | undefined {
  if (value === null) return undefined;
  const text = value.trim();
  if (/^\d{1,9}$/.test(text)) return Number(text) * 1000;
  const at = Date.parse(text);
  return Number.isNaN(at) ? undefined : Math.max(0, at - nowMs);
}

/** Exponential backoff with full jitter: a random wait up to `min(cap, base * 2^attempt)`. */
export function backoffMs(policy: RetryPolicy, attempt: number): number {
  return Math.floor(policy.random() * Math.min(policy.capMs, policy.baseMs * 2 ** attempt));
}

/**
 * How long to wait before trying a request again after `status`, or
 * undefined when it must not be tried again: 408, 429 and 5xx are retried
 * (not 501, an unknown method, which never succeeds); other 4xx are the
 * request's own fault. The one exception is a keyed POST's `409` with
 * `Retry-After`: the same key's first request is still in progress, and the
 * contract asks the client to come back.
 */
export function retryDelayMs(
  policy: RetryPolicy,
  response: { status: number; headers: Headers },
  attempt: number,
  keyed: boolean,
): number | undefined {
  const { status, headers } = response;
  const asked = retryAfterMs(headers.get("retry-after"), policy.now());
  const retryable = status === 408 || status === 429 || (status >= 500 && status !== 501) ||
    (status === 409 && keyed && asked !== undefined);
  if (!retryable) return undefined;
  if (asked === undefined) return backoffMs(policy, attempt);
  // A budget that resets at midnight is not worth holding a request open for: the caller decides.
  return asked > policy.maxRetryAfterMs ? undefined : asked;
}

/** Resolves after `ms`, or rejects with the signal's reason as soon as it aborts. */
export function abortableSleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const onAbort = () => {
      clearTimeout(timer);
      reject(signal?.reason);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}
