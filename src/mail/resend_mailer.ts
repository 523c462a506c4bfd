import { ConnectionError, isNotCapable, PermissionDenied, UpstreamHttpError } from "../retry/errors.ts";
import { linkedSignal } from "../async/linked_signal.ts";
import type { Mailer } from "./mailer.ts";
import { PermanentMailError } from "./mailer.ts";

/** Options for {@linkcode createResendMailer}. */
export interface ResendOptions {
  apiKey: string;
  /** e.g. `https://api.resend.com` */
  baseUrl: string;
  /** Wall-clock cap of one send (MAIL_SEND_TIMEOUT_S). */
  timeoutMs: number;
  fetch?: typeof fetch;
}

// Resend's 409s: one is a key still in flight (retry later), the other a key
// reused with a different payload (no retry can fix that).
const IN_FLIGHT_409 = "concurrent_idempotent_requests";

/**
 * Classifies a provider's HTTP answer. 2xx is sent; 408, 429, 5xx and an
 * in-flight 409 are retried on a later pass; any other 4xx is permanent.
 * @throws {PermanentMailError} or {@linkcode UpstreamHttpError} (retryable).
 */
export function classifyMailResponse(status: number, headers: Headers, body: string): void {
  if (status >= 200 && status < 300) return;
  if (status === 409 && body.includes(IN_FLIGHT_409)) throw new UpstreamHttpError(status, headers, body);
  if (status === 408 || status === 429 || status >= 500) throw new UpstreamHttpError(status, headers, body);
  throw new PermanentMailError(`mail provider answered ${status}: ${body.slice(0, 300)}`, status);
}

/** A Resend-compatible {@linkcode Mailer}: `POST {baseUrl}/emails` with an Idempotency-Key. */
export function createResendMailer(options: ResendOptions): Mailer {
  const doFetch = options.fetch ?? fetch;
  const url = `${options.baseUrl.replace(/\/+$/, "")}/emails`;
  return {
    async send(email, idempotencyKey, signal) {
      const timeout = AbortSignal.timeout(options.timeoutMs);
      // Linked for this send only: the relay's stop signal outlives every send (see linkedSignal).
      const linked = linkedSignal(signal, timeout);
      let response: Response;
      let body: string;
      try {
        // The timeout covers the body too, so a dripping answer cannot hold the send.
        response = await doFetch(url, {
          method: "POST",
          headers: {
            authorization: `Bearer ${options.apiKey}`,
            "content-type": "application/json",
            "idempotency-key": idempotencyKey,
          },
          body: JSON.stringify(email),
          signal: linked.signal,
        });
        body = await response.text();
      } catch (cause) {
        if (signal.aborted) throw cause;
        if (timeout.aborted) {
          throw new DOMException(`mail send timed out after ${options.timeoutMs} ms`, "TimeoutError");
        }
        if (isNotCapable(cause)) {
          throw new PermissionDenied(
            "this process's permission set does not allow the mail provider's host (RESEND_BASE_URL): " +
              "add it to the task's --allow-net or fix the URL",
            { cause },
          );
        }
        throw new ConnectionError(`mail provider unreachable: ${(cause as Error).message}`, { cause });
      } finally {
        linked.unlink();
      }
      classifyMailResponse(response.status, response.headers, body);
      let providerId: string | undefined;
      try {
        providerId = (JSON.parse(body) as { id?: string }).id;
      } catch { /* a 2xx without a JSON body is still sent */ }
      return { ok: true, providerId };
    },
  };
}
