/**
 * Webhook delivery over a socket pinned to an address we checked. `fetch`
 * resolves the host name again by itself (a DNS rebinding window) and follows
 * redirects (to anywhere, the metadata service included), so it is not used.
 */
import { AttemptTimeout, ConnectionError, isNotCapable, PermissionDenied, UpstreamHttpError } from "../retry/errors.ts";
import {
  checkWebhookUrl,
  type ResolveHost,
  resolvePublic,
  WebhookRefused,
  type WebhookUrlPolicy,
} from "./addresses.ts";
import { signWebhook } from "./signature.ts";

/** The default cap on a response's status line and headers. */
export const MAX_HEAD_BYTES_DEFAULT = 16_384;

const USER_AGENT = "Oncely-Webhooks/1";

// Written by postPinned itself: a caller's copy would make the request ambiguous (smuggling).
const RESERVED_HEADERS: ReadonlySet<string> = new Set([
  "host",
  "content-type",
  "content-length",
  "transfer-encoding",
  "connection",
  "user-agent",
]);

/** One POST to a pinned address. */
export interface PinnedPost {
  /** Gives the Host header, the request target, the port and the TLS server name. */
  url: URL;
  /** The IP address to connect to, already checked by {@linkcode resolvePublic}. */
  address: string;
  headers: Record<string, string>;
  body: string;
  /** Caps the whole exchange: connect, TLS, write and the response head. */
  timeoutMs: number;
  signal?: AbortSignal;
  maxHeadBytes?: number;
  /** Extra trusted CA certificates (PEM), for tests and private CAs. */
  caCerts?: string[];
}

/** The status line and headers of the answer; the body is never read. */
export interface PinnedResponse {
  status: number;
  headers: Headers;
}

/** Rejects with `signal`'s reason when it aborts first; a value that arrives too late goes to `discard`. */
function raceAbort<T>(promise: Promise<T>, signal: AbortSignal, discard: (late: T) => void = () => {}): Promise<T> {
  return new Promise((resolve, reject) => {
    const onAbort = () => reject(signal.reason);
    if (signal.aborted) onAbort();
    else signal.addEventListener("abort", onAbort, { once: true });
    promise.then((value) => {
      signal.removeEventListener("abort", onAbort);
      if (signal.aborted) discard(value);
      else resolve(value);
    }, (error) => {
      signal.removeEventListener("abort", onAbort);
      reject(error);
    });
  });
}

/** An abort signal that fires with {@linkcode AttemptTimeout} after `timeoutMs`, or with `signal`'s reason. */
function deadline(timeoutMs: number, what: string, signal?: AbortSignal): { signal: AbortSignal; clear(): void } {
  const controller = new AbortController();
  const timer = setTimeout(
    () => controller.abort(new AttemptTimeout(`${what} timed out after ${timeoutMs} ms`)),
    timeoutMs,
  );
  const onAbort = () => controller.abort(signal!.reason);
  if (signal?.aborted) onAbort();
  else signal?.addEventListener("abort", onAbort, { once: true });
  return {
    signal: controller.signal,
    clear() {
      clearTimeout(timer);
      signal?.removeEventListener("abort", onAbort);
    },
  };
}

function requestHead(url: URL, headers: Record<string, string>, contentLength: number): string {
  const lines = [
    `POST ${url.pathname}${url.search} HTTP/1.1`,
    `Host: ${url.host}`,
    "Content-Type: application/json",
    `Content-Length: ${contentLength}`,
    "Connection: close",
    `User-Agent: ${USER_AGENT}`,
  ];
  for (const [name, value] of Object.entries(headers)) {
    if (!/^[!#$%&'*+.^_`|~0-9A-Za-z-]+$/.test(name)) throw new TypeError(`invalid header name ${JSON.stringify(name)}`);
    if (RESERVED_HEADERS.has(name.toLowerCase())) throw new TypeError(`header ${name} is set by postPinned itself`);
    // A CR or LF would let a value start a header or a request of its own.
    if (/[\r\n\0]/.test(value)) throw new TypeError(`header ${name} has a CR, LF or NUL in its value`);
    lines.push(`${name}: ${value}`);
  }
  return lines.join("\r\n") + "\r\n\r\n";
}

async function writeAll(conn: Deno.Conn, bytes: Uint8Array): Promise<void> {
  for (let written = 0; written < bytes.length;) written += await conn.write(bytes.subarray(written));
}

function latin1(bytes: Uint8Array): string {
  let text = "";
  for (const byte of bytes) text += String.fromCharCode(byte);
  return text;
}

/**
 * Reads up to the end of the final (non-1xx) response head, never more than
 * `maxHeadBytes` in all, so a receiver cannot make us buffer without bound.
 */
async function readHead(conn: Deno.Conn, maxHeadBytes: number): Promise<PinnedResponse> {
  const buffer = new Uint8Array(maxHeadBytes);
  let filled = 0;
  let start = 0; // where the current head begins (after skipped 1xx heads)
  let scanned = 0; // bytes before this were searched already: each byte is looked at about once
  for (;;) {
    const end = blankLineAt(buffer, Math.max(start, scanned - 3), filled);
    scanned = filled;
    if (end !== -1) {
      // Decoded once, when complete: a receiver dripping its head a byte at a time costs linear work.
      const [statusLine = "", ...fields] = latin1(buffer.subarray(start, end)).split("\r\n");
      const match = /^HTTP\/1\.[01] ([1-5]\d\d)(?: |$)/.exec(statusLine);
      if (!match) {
        throw new ConnectionError(`webhook receiver sent a malformed status line (${statusLine.slice(0, 80)})`);
      }
      const status = Number(match[1]);
      start = end + 4;
      scanned = start;
      if (status >= 100 && status < 200 && status !== 101) continue;
      const headers = new Headers();
      for (const field of fields) {
        const colon = field.indexOf(":");
        try {
          if (colon > 0) headers.append(field.slice(0, colon), field.slice(colon + 1));
        } catch { /* a malformed field line tells us nothing we act on */ }
      }
      return { status, headers };
    }
    if (filled === buffer.length) {
      throw new ConnectionError(`webhook receiver's response head is larger than ${maxHeadBytes} bytes`);
    }
    const n = await conn.read(buffer.subarray(filled));
    if (n === null) throw new ConnectionError("webhook receiver closed the connection before answering");
    filled += n;
  }
}

/**
 * Where the first CRLF CRLF in `bytes[from, to)` begins, or -1. Searched on
 * the bytes themselves: nothing is decoded until a head is complete.
 */
export function blankLineAt(bytes: Uint8Array, from: number, to: number): number {
  for (let i = Math.max(0, from); i + 3 < to; i++) {
    if (bytes[i] === 13 && bytes[i + 1] === 10 && bytes[i + 2] === 13 && bytes[i + 3] === 10) return i;
  }
  return -1;
}

/**
 * POSTs `body` over HTTP/1.1 to `address`, with TLS verified against the
 * URL's host name for https, and returns the status and headers only.
 * Redirects are not followed: that is the caller's decision.
 * @throws {TypeError} for a header name or value that cannot be written safely.
 * @throws {AttemptTimeout} after `timeoutMs`; the signal's reason when it aborts.
 * @throws {ConnectionError} when refused, reset, the TLS handshake fails, or the answer is malformed or too large.
 * @throws {PermissionDenied} when this process may not connect there.
 */
export async function postPinned(options: PinnedPost): Promise<PinnedResponse> {
  const { url, address, body, timeoutMs, signal, maxHeadBytes = MAX_HEAD_BYTES_DEFAULT } = options;
  const payload = new TextEncoder().encode(body);
  const head = new TextEncoder().encode(requestHead(url, options.headers, payload.length));
  const https = url.protocol === "https:";
  const port = url.port === "" ? (https ? 443 : 80) : Number(url.port);
  const where = `webhook POST to ${url.host} (${address})`;
  const limit = deadline(timeoutMs, where, signal);
  let open: Deno.Conn | undefined;
  // Closing the socket is what interrupts a pending read or write when time runs out.
  const close = () => {
    try {
      open?.close();
    } catch { /* already closed */ }
    open = undefined;
  };
  limit.signal.addEventListener("abort", close, { once: true });
  try {
    const tcp = await raceAbort(Deno.connect({ hostname: address, port }), limit.signal, (late) => late.close());
    let conn: Deno.Conn = open = tcp;
    if (https) {
      open = undefined; // startTls owns the TCP socket from here on
      const tls = await raceAbort(
        Deno.startTls(tcp, { hostname: url.hostname.replace(/^\[(.*)\]$/, "$1"), caCerts: options.caCerts }),
        limit.signal,
        (late) => late.close(),
      );
      conn = open = tls;
      try {
        await raceAbort(tls.handshake(), limit.signal);
      } catch (cause) {
        if (limit.signal.aborted) throw cause;
        throw new ConnectionError(`TLS handshake with ${url.hostname} failed: ${(cause as Error).message}`, { cause });
      }
    }
    await writeAll(conn, head);
    await writeAll(conn, payload);
    return await readHead(conn, maxHeadBytes);
  } catch (cause) {
    if (limit.signal.aborted) throw limit.signal.reason;
    if (cause instanceof ConnectionError) throw cause;
    if (isNotCapable(cause)) {
      throw new PermissionDenied(`this process's permission set does not allow the ${where}`, { cause });
    }
    throw new ConnectionError(`${where} failed: ${(cause as Error).message}`, { cause });
  } finally {
    limit.signal.removeEventListener("abort", close);
    limit.clear();
    close();
  }
}

/** One webhook message to deliver. */
export interface WebhookDelivery {
  url: URL | string;
  policy: WebhookUrlPolicy;
  /** Signing secrets, newest first; never logged nor put in an error. */
  secrets: string[];
  /** The message id, the same on every attempt so receivers can dedupe. */
  id: string;
  /** JSON text, sent as is. */
  body: string;
  /** Caps DNS resolution and the POST together. */
  timeoutMs: number;
  signal?: AbortSignal;
  resolve?: ResolveHost;
  /** Milliseconds since the epoch, for `webhook-timestamp`. */
  now?: () => number;
  caCerts?: string[];
}

/**
 * Delivers one signed webhook to a checked, pinned address. 2xx is delivered.
 * @throws {WebhookRefused} for a refused URL or address, or a 3xx (redirects are not followed). Permanent.
 * @throws {UpstreamHttpError} for 408, 429 and 5xx (retryable; Retry-After is in its headers) and any other 4xx but 409 (permanent).
 * @throws {WebhookRefused} for a 409, which the shared classification would otherwise retry.
 * @throws {ConnectionError} or {@linkcode AttemptTimeout} (retryable), as {@linkcode postPinned}.
 */
export async function sendWebhook(delivery: WebhookDelivery): Promise<void> {
  const { policy, timeoutMs } = delivery;
  const url = typeof delivery.url === "string" ? checkWebhookUrl(delivery.url, policy) : delivery.url;
  const started = performance.now();
  const limit = deadline(timeoutMs, `webhook DNS lookup of ${url.hostname}`, delivery.signal);
  let addresses: string[];
  try {
    addresses = await raceAbort(resolvePublic(url, policy, delivery.resolve), limit.signal);
  } finally {
    limit.clear();
  }
  const timestamp = Math.floor((delivery.now ?? Date.now)() / 1000);
  const signature = await signWebhook({ id: delivery.id, timestamp, body: delivery.body, secrets: delivery.secrets });
  const { status, headers } = await postPinned({
    url,
    address: addresses[0]!,
    headers: { "webhook-id": delivery.id, "webhook-timestamp": String(timestamp), "webhook-signature": signature },
    body: delivery.body,
    timeoutMs: Math.max(1, timeoutMs - (performance.now() - started)),
    signal: delivery.signal,
    caCerts: delivery.caCerts,
  });
  if (status >= 200 && status < 300) return;
  const answered = new UpstreamHttpError(status, headers, "");
  if (status >= 300 && status < 400) {
    throw new WebhookRefused(`the receiver answered ${status} (redirects are not followed)`, { cause: answered });
  }
  // classify.ts retries every 409 (a provider's "request in flight"); a receiver's 409 is its final word.
  if (status === 409) {
    throw new WebhookRefused("the receiver answered 409 (webhooks are not retried on 409)", { cause: answered });
  }
  throw answered;
}
