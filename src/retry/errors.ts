/**
 * The time budget of one delivery is spent. Deliberately not a timeout: it is
 * never retried in-process. A job treats it as transient, so the message is
 * redelivered with a fresh budget and MAX_DELIVERIES caps the total.
 */
export class DeadlineExceeded extends Error {
  constructor(message: string, options?: ErrorOptions) {
    super(message, options);
    this.name = "DeadlineExceeded";
  }
}

/** One attempt ran past its wall-clock cap. Retryable. */
export class AttemptTimeout extends Error {
  constructor(message: string, options?: ErrorOptions) {
    super(message, options);
    this.name = "AttemptTimeout";
  }
}

/** A non-2xx answer from an HTTP provider called with plain `fetch`. */
export class UpstreamHttpError extends Error {
  /** What the vendor's adapter read in the answer that waiting will not fix; see {@linkcode Refusal}. */
  readonly refusal?: Refusal;
  constructor(
    readonly status: number,
    readonly headers: Headers,
    readonly body: string,
    options?: ErrorOptions & { refusal?: Refusal },
  ) {
    super(`Upstream answered ${status}: ${body.slice(0, 200)}`, options);
    this.name = "UpstreamHttpError";
    if (options?.refusal) this.refusal = options.refusal;
  }
}

/**
 * A provider's refusal that waiting will not fix, as the vendor's adapter
 * reads it from the answer: `quota_exhausted` (the account's quota is spent),
 * `request_too_large` (this request alone exceeds a per-minute limit).
 */
export type Refusal = "quota_exhausted" | "request_too_large";

/** The request never got an HTTP answer (refused, reset, DNS). Retryable. */
export class ConnectionError extends Error {
  constructor(message: string, options?: ErrorOptions) {
    super(message, options);
    this.name = "ConnectionError";
  }
}

/** The shared flow control could not be asked (its Redis is unreachable). Transient: the job is redelivered. */
export class GateUnavailable extends Error {
  constructor(message: string, options?: ErrorOptions) {
    super(message, options);
    this.name = "GateUnavailable";
  }
}

/** The shared flow control says this call can never go (it exceeds the provider's limit on its own). Permanent. */
export class GateRefused extends Error {
  constructor(message: string, options?: ErrorOptions) {
    super(message, options);
    this.name = "GateRefused";
  }
}

/**
 * The process's permission set refused a connection (Deno's `NotCapable`): a
 * deployment mistake that no retry can fix, reported by name instead of as a
 * connection error retried for ever.
 */
export class PermissionDenied extends Error {
  constructor(message: string, options?: ErrorOptions) {
    super(message, options);
    this.name = "PermissionDenied";
  }
}

/** Whether `error`, or an error in its `cause` chain, is Deno's permission denial. */
export function isNotCapable(error: unknown): boolean {
  for (let e = error, depth = 0; e instanceof Error && depth < 5; e = e.cause, depth++) {
    if (e.name === "NotCapable" || /Requires net access/.test(e.message)) return true;
  }
  return false;
}
