/** A job that can never succeed: it goes to the dead-letter stream at once, without redelivery. */
export class PermanentJobError extends Error {
  constructor(message: string, options?: ErrorOptions) {
    super(message, options);
    this.name = "PermanentJobError";
  }
}
