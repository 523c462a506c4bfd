/** Another request with the same key is still running; the client should retry shortly. */
export class RequestInProgress extends Error {
  constructor(message = "A request with this Idempotency-Key is still in progress", options?: ErrorOptions) {
    super(message, options);
    this.name = "RequestInProgress";
  }
}

/** The key was used before with a different request body. */
export class KeyReused extends Error {
  constructor(message = "This Idempotency-Key was used with a different request body", options?: ErrorOptions) {
    super(message, options);
    this.name = "KeyReused";
  }
}
