import type { Problem } from "./documents.ts";

/**
 * The API answered with an error status (after any retries): `status` and
 * the RFC 9457 problem document it sent. A body that was not a problem
 * document (a proxy's HTML page) becomes one with its status and text.
 */
export class OncelyError extends Error {
  readonly status: number;
  readonly problem: Problem;
  /** Seconds the server asked to wait before trying again (`Retry-After`), when it said. */
  readonly retryAfterS: number | undefined;

  constructor(problem: Problem, options: ErrorOptions & { retryAfterS?: number } = {}) {
    const where = problem.errors?.[0];
    const first = where ? ` (${where.pointer ?? where.path ?? ""}: ${where.message})` : "";
    super(`Oncely answered ${problem.status} ${problem.title}: ${problem.detail ?? ""}${first}`, options);
    this.name = "OncelyError";
    this.status = problem.status;
    this.problem = problem;
    this.retryAfterS = options.retryAfterS;
  }
}

/**
 * A webhook that must not be trusted: a signature that matches none of the
 * secrets, a timestamp outside the tolerance, a missing header, or a body
 * that is not JSON. Answer it with a 4xx and do not act on it.
 */
export class WebhookVerificationError extends Error {
  constructor(message: string, options?: ErrorOptions) {
    super(message, options);
    this.name = "WebhookVerificationError";
  }
}
