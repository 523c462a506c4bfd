import type { Logger } from "../log/logger.ts";

const TITLES: Record<number, string> = {
  400: "Bad Request",
  401: "Unauthorized",
  404: "Not Found",
  405: "Method Not Allowed",
  408: "Request Timeout",
  409: "Conflict",
  413: "Content Too Large",
  415: "Unsupported Media Type",
  422: "Unprocessable Content",
  429: "Too Many Requests",
  500: "Internal Server Error",
  501: "Not Implemented",
  503: "Service Unavailable",
};

/** An error that becomes an RFC 9457 problem response with `status`. */
export class HttpError extends Error {
  constructor(
    readonly status: number,
    readonly detail: string,
    readonly headers: Record<string, string> = {},
    options?: ErrorOptions & { type?: string; extra?: Record<string, unknown>; shed?: boolean },
  ) {
    super(detail, options);
    this.name = "HttpError";
    this.type = options?.type ?? "about:blank";
    this.extra = options?.extra ?? {};
    this.shed = options?.shed ?? false;
  }
  readonly type: string;
  readonly extra: Record<string, unknown>;
  /**
   * A 503 that sheds load by design (a cap reached, `Retry-After` set), not a failure: logged as a refusal, folded,
   * not as an error per request (a flood over a cap would write a line per request; see README, "Observe").
   */
  readonly shed: boolean;
}

/** Builds an `application/problem+json` response. */
export function problem(
  status: number,
  detail: string,
  headers: Record<string, string> = {},
  fields: { type?: string; extra?: Record<string, unknown> } = {},
): Response {
  const body = {
    type: fields.type ?? "about:blank",
    title: TITLES[status] ?? "Error",
    status,
    detail,
    ...fields.extra,
  };
  return new Response(JSON.stringify(body), {
    status,
    headers: { ...headers, "content-type": "application/problem+json" },
  });
}

/**
 * The one place errors become responses. An {@linkcode HttpError} keeps its
 * status and detail; anything else is a 500 with a generic detail, logged
 * here, so no stack trace or internal message ever leaves the process.
 */
export function errorResponse(error: unknown, log: Logger, fields: Record<string, unknown> = {}): Response {
  if (error instanceof HttpError) {
    if (error.status >= 500 && !error.shed) log.error("request_failed", { ...fields, status: error.status, error });
    else logRefusal(log, { ...fields, status: error.status, detail: error.detail });
    return problem(error.status, error.detail, error.headers, { type: error.type, extra: error.extra });
  }
  log.error("request_failed", { ...fields, status: 500, error });
  return problem(500, "The server could not complete the request; it is safe to retry with the same Idempotency-Key");
}

/** How long identical client-error lines are folded into one. */
const REFUSAL_WINDOW_MS = 10_000;
const refusals = new Map<string, { at: number; folded: number }>();

/**
 * A client error (4xx) is one `request_refused` line at info level, and the
 * same line again within 10 s is only counted: a client repeating a bad
 * request thousands of times a second cannot flood the log. The next line
 * after a window says how many it folded (`repeated`).
 */
function logRefusal(log: Logger, fields: Record<string, unknown>): void {
  // Every field is cut short: a path or a detail may carry much of what the client sent, and neither the map
  // nor the log may grow with it.
  const bounded = Object.fromEntries(
    Object.entries(fields).map(([k, v]) => [k, typeof v === "string" && v.length > 200 ? `${v.slice(0, 200)}...` : v]),
  );
  const key = JSON.stringify(bounded);
  const now = performance.now();
  const seen = refusals.get(key);
  if (seen && now - seen.at < REFUSAL_WINDOW_MS) {
    seen.folded++;
    return;
  }
  refusals.delete(key);
  if (refusals.size >= 1_000) {
    // Oldest first (a Map keeps insertion order): expired entries, then, if a flood fills it, the oldest.
    for (const [k, v] of refusals) {
      if (refusals.size < 1_000 && now - v.at < REFUSAL_WINDOW_MS) break;
      refusals.delete(k);
    }
  }
  refusals.set(key, { at: now, folded: 0 });
  log.info("request_refused", seen?.folded ? { ...bounded, repeated: seen.folded } : bounded);
}
