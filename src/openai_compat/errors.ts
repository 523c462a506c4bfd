/**
 * Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, on the OpenAI-compatible paths
 * only, so the SDKs raise their own classes (`AuthenticationError` for 401, `NotFoundError` for 404,
 * `UnprocessableEntityError` for 422, `RateLimitError` for 429). Statuses are the API's own.
 */
import { HttpError } from "../http/problem.ts";
import { json } from "../http/router.ts";
import type { Logger } from "../log/logger.ts";
import { BUDGET_EXHAUSTED } from "../runs/http.ts";

/** A refusal of an OpenAI-compatible request: an {@linkcode HttpError} with OpenAI's `param`, `code` and `type`. */
export class OpenAiRefusal extends HttpError {
  constructor(
    status: number,
    message: string,
    readonly openai: { param?: string; code?: string; type?: string } = {},
    headers: Record<string, string> = {},
  ) {
    super(status, message, headers);
    this.name = "OpenAiRefusal";
  }
}

/** OpenAI's error `type` for a status. */
function typeOf(status: number): string {
  if (status === 401) return "authentication_error";
  if (status === 429) return "rate_limit_error";
  if (status >= 500) return "server_error";
  return "invalid_request_error";
}

/** A JSON pointer (`/messages/0/content`) as OpenAI names a parameter (`messages[0].content`). */
export function paramOf(pointer: string): string {
  return pointer.split("/").slice(1).map((p) => p.replace(/~1/g, "/").replace(/~0/g, "~"))
    .reduce((name, part) => /^\d+$/.test(part) ? `${name}[${part}]` : name ? `${name}.${part}` : part, "");
}

/**
 * An error as an OpenAI-shaped response: an {@linkcode HttpError} keeps its status, headers and message (a
 * problem's first `errors` entry names the param); anything else is a logged `500` with a generic message.
 * A spent budget is `429` with code `budget_exhausted` and `x-should-retry: false` (waiting will not help
 * before its period ends).
 */
export function openAiErrorResponse(error: unknown, log: Logger, headers: Record<string, string> = {}): Response {
  if (!(error instanceof HttpError)) {
    log.error("request_failed", { status: 500, error });
    return body(500, "The server could not complete the request; retrying with the same Idempotency-Key is safe", {
      type: "server_error",
    }, headers);
  }
  if (error.status >= 500 && !error.shed) log.error("request_failed", { status: error.status, error });
  const own = error instanceof OpenAiRefusal ? error.openai : {};
  const first = (error.extra.errors as { pointer?: string; path?: string }[] | undefined)?.[0];
  const param = own.param ?? (first?.pointer ? paramOf(first.pointer) : first?.path);
  const budget = error.type === BUDGET_EXHAUSTED;
  const code = own.code ?? (budget ? "budget_exhausted" : error.status === 401 ? "invalid_api_key" : undefined);
  return body(error.status, error.detail, { type: own.type ?? typeOf(error.status), param, code }, {
    ...error.headers,
    ...(budget ? { "x-should-retry": "false" } : {}),
    ...headers,
  });
}

function body(
  status: number,
  message: string,
  { type, param, code }: { type: string; param?: string; code?: string },
  headers: Record<string, string>,
): Response {
  return json(status, { error: { message, type, param: param ?? null, code: code ?? null } }, headers);
}
