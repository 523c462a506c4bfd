import type { Clock } from "./clock.ts";
import { systemClock } from "./clock.ts";

/** A monotonic time budget covering every attempt and sleep of one delivery. */
export class Deadline {
  private constructor(private end: number, private readonly clock: Clock) {}

  /** A deadline `ms` from now on `clock`. */
  static after(ms: number, clock: Clock = systemClock): Deadline {
    return new Deadline(clock.now() + ms, clock);
  }

  /** Milliseconds left, never negative. */
  remaining(): number {
    return Math.max(0, this.end - this.clock.now());
  }

  /** Moves the end `ms` later: time the job spent waiting for the provider is not charged to it. */
  extend(ms: number): void {
    if (ms > 0) this.end += ms;
  }

  get expired(): boolean {
    return this.remaining() === 0;
  }
}
