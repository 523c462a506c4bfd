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
    options?: ErrorOptions & { type?: string; extra?: Record<string, unknown> },
  ) {
    super(detail, options);
    this.name = "HttpError";
    this.type = options?.type ?? "about:blank";
    this.extra = options?.extra ?? {};
  }
  readonly type: string;
  readonly extra: Record<string, unknown>;
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
    if (error.status >= 500) log.error("request_failed", { ...fields, status: error.status, error });
    return problem(error.status, error.detail, error.headers, { type: error.type, extra: error.extra });
  }
  log.error("request_failed", { ...fields, status: 500, error });
  return problem(500, "The server could not complete the request; it is safe to retry with the same Idempotency-Key");
}
