/** An email as the providers see it. */
export interface Email {
  from: string;
  to: string[];
  subject: string;
  text: string;
}

/** What a send attempt came to. */
export type SendResult = { ok: true; providerId?: string };

/** A mail provider. */
export interface Mailer {
  /**
   * Sends `email`. The provider must dedupe on `idempotencyKey`, which covers
   * a crash after it accepted the send but before we recorded it.
   * @throws {PermanentMailError} when no retry can fix the send; a transport error (`UpstreamHttpError`,
   * `ConnectionError`, a timeout) when a later pass may succeed.
   */
  send(email: Email, idempotencyKey: string, signal: AbortSignal): Promise<SendResult>;
}

/** A send that no retry can fix (a 4xx other than 408/429, or a reused key with another payload). */
export class PermanentMailError extends Error {
  constructor(message: string, readonly status?: number, options?: ErrorOptions) {
    super(message, options);
    this.name = "PermanentMailError";
  }
}
