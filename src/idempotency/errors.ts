/** The key was used before with a different request body. */
export class KeyReused extends Error {
  constructor(message = "This Idempotency-Key was used with a different request body", options?: ErrorOptions) {
    super(message, options);
    this.name = "KeyReused";
  }
}
