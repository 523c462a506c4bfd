/** A job that can never succeed: it goes to the dead-letter stream at once, without redelivery. */
export class PermanentJobError extends Error {
  constructor(message: string, options?: ErrorOptions) {
    super(message, options);
    this.name = "PermanentJobError";
  }
}

/**
 * A job that cannot run now (its tenant's budget is spent): its message goes back to the end of its lane at
 * once, acknowledged and added again in one step, so waiting spends none of its deliveries.
 */
export class JobDeferred extends Error {
  constructor(message: string, options?: ErrorOptions) {
    super(message, options);
    this.name = "JobDeferred";
  }
}
