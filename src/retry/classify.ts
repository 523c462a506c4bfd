import { TimeoutError } from "../async/timeout.ts";
import { AttemptTimeout, ConnectionError, DeadlineExceeded, PermissionDenied, UpstreamHttpError } from "./errors.ts";

/** Statuses a later attempt can fix, besides every 5xx (the same set the OpenAI SDK uses). */
export const RETRYABLE_STATUS: ReadonlySet<number> = new Set([408, 409, 429]);

/** The HTTP status an upstream answered with. */
export function statusOf(error: unknown): number | undefined {
  return error instanceof UpstreamHttpError ? error.status : undefined;
}

/** The response headers an upstream answered with. */
export function headersOf(error: unknown): Headers | undefined {
  return error instanceof UpstreamHttpError ? error.headers : undefined;
}

/** Whether the provider says the account's quota is spent: waiting will not fix that. */
export function isQuotaExhausted(error: unknown): boolean {
  return error instanceof UpstreamHttpError && error.refusal === "quota_exhausted";
}

/**
 * Whether the provider refused a request because it alone exceeds a
 * per-minute limit. Waiting will not fix that: it is about this document.
 */
export function isRequestTooLarge(error: unknown): boolean {
  return error instanceof UpstreamHttpError && error.status === 429 && error.refusal === "request_too_large";
}

/**
 * Whether a later attempt can succeed. Timeouts, connection errors, 408,
 * 409, 429 and every 5xx are retryable. {@linkcode DeadlineExceeded} is not,
 * nor is a 429 for an exhausted quota, nor any unknown error: a bug fails the
 * same way every time, so it is not worth paying for again.
 */
export function isRetryable(error: unknown): boolean {
  if (error instanceof DeadlineExceeded) return false;
  if (error instanceof AttemptTimeout || error instanceof TimeoutError || error instanceof ConnectionError) {
    return true;
  }
  if (error instanceof DOMException && error.name === "TimeoutError") return true;
  const status = statusOf(error);
  if (status === undefined) return false;
  if (status === 429 && (isQuotaExhausted(error) || isRequestTooLarge(error))) return false;
  return RETRYABLE_STATUS.has(status) || status >= 500;
}

/** A short reason label for logs and metrics: `timeout`, `connection`, `http_429`, ... */
export function reasonOf(error: unknown): string {
  if (error instanceof DeadlineExceeded) return "deadline";
  if (
    error instanceof AttemptTimeout || error instanceof TimeoutError ||
    (error instanceof DOMException && error.name === "TimeoutError")
  ) return "timeout";
  if (error instanceof PermissionDenied) return "permission_denied";
  if (error instanceof ConnectionError) return "connection";
  const status = statusOf(error);
  if (status !== undefined) return `http_${status}`;
  return error instanceof Error ? error.name : "unknown";
}

/**
 * The wait the provider asked for, in ms: `retry-after-ms`, or `Retry-After`
 * as seconds or an HTTP date. Undefined when absent or unparseable.
 */
export function retryAfterMs(error: unknown, nowEpochMs: number = Date.now()): number | undefined {
  const headers = headersOf(error);
  if (!headers) return undefined;
  const ms = headers.get("retry-after-ms");
  if (ms !== null && /^\d+(\.\d+)?$/.test(ms.trim())) return Number(ms);
  const after = headers.get("retry-after");
  if (after === null) return undefined;
  if (/^\d+(\.\d+)?$/.test(after.trim())) return Number(after) * 1000;
  const date = Date.parse(after);
  return Number.isNaN(date) ? undefined : Math.max(0, date - nowEpochMs);
}

/**
 * Whom a failed model call says something about, for the shared flow control:
 * - `rate_limited`: a 429 that is not about quota; every worker pauses until the provider's reset.
 * - `quota`: the account's quota is spent; the provider is unusable until someone pays, so the breaker opens.
 * - `unauthorized`: 401 or 403 (a wrong or revoked key, no access to the model): unusable for everyone
 *   until someone fixes the key, so the breaker opens as for `quota`.
 * - `provider`: timeouts, connection errors, 408 and 5xx; a run of them from several jobs opens the breaker.
 * - `request`: anything else (400 context too long, 409, a bug): about this call alone.
 */
export type FailureKind = "rate_limited" | "quota" | "unauthorized" | "provider" | "request";

/**
 * Whether a `provider` failure cannot be one document's: a connection error (refused, reset), 502, 503 or 504
 * (a gateway or an overloaded service), or any answer with Retry-After (the provider asks everyone to wait). A
 * timeout, a 500 or another 5xx may be the document's (a model that hangs or fails on it).
 */
export function isProviderWide(error: unknown): boolean {
  if (reasonOf(error) === "connection") return true;
  const status = statusOf(error);
  if (status === 502 || status === 503 || status === 504) return true;
  return status !== undefined && retryAfterMs(error) !== undefined;
}

/** Classifies a failed model call; see {@linkcode FailureKind}. */
export function failureKindOf(error: unknown): FailureKind {
  const status = statusOf(error);
  if (status === 429) return isQuotaExhausted(error) ? "quota" : isRequestTooLarge(error) ? "request" : "rate_limited";
  if (status === 401 || status === 403) return "unauthorized";
  if (status !== undefined) return status === 408 || status >= 500 ? "provider" : "request";
  return reasonOf(error) === "timeout" || reasonOf(error) === "connection" ? "provider" : "request";
}
