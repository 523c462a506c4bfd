/**
 * The OpenAI SDK's errors, turned into the service's transport vocabulary
 * (`UpstreamHttpError`, `ConnectionError`, `AttemptTimeout`) at the edge of
 * the adapter, so that retry and flow-control code never sees a vendor class.
 */
import { APIConnectionError, APIConnectionTimeoutError, APIError, APIUserAbortError } from "openai";
import {
  AttemptTimeout,
  ConnectionError,
  isNotCapable,
  PermissionDenied,
  type Refusal,
  UpstreamHttpError,
} from "../retry/errors.ts";

/** @returns the neutral error for an SDK error (the SDK's own one as `cause`); anything else unchanged. */
export function fromOpenAiError(error: unknown): unknown {
  // Our own abort (a timeout race or shutdown): the caller knows why, so keep it as it is.
  if (error instanceof APIUserAbortError) return error;
  if (error instanceof APIConnectionTimeoutError) return new AttemptTimeout(error.message, { cause: error });
  if (error instanceof APIConnectionError) {
    if (isNotCapable(error)) {
      return new PermissionDenied(
        "this process's permission set does not allow the model provider's host (OPENAI_BASE_URL): " +
          "add it to the task's --allow-net or fix the URL",
        { cause: error },
      );
    }
    return new ConnectionError(error.message, { cause: error });
  }
  if (error instanceof APIError && typeof error.status === "number") {
    // The provider's error document, as it sent it: its code says quota or rate limit, its message "too large".
    const body = JSON.stringify(error.error ?? { message: error.message });
    return new UpstreamHttpError(error.status, new Headers(error.headers ?? {}), body, {
      cause: error,
      refusal: refusalOf(error.status, body),
    });
  }
  return error;
}

/**
 * What OpenAI's error document says waiting will not fix: `insufficient_quota`
 * (its code or type), or a 429 "Request too large ... on tokens per min".
 */
export function refusalOf(status: number, body: string): Refusal | undefined {
  if (body.includes("insufficient_quota")) return "quota_exhausted";
  if (status === 429 && /request too large/i.test(body)) return "request_too_large";
  return undefined;
}
