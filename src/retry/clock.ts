import { sleep } from "../async/timeout.ts";

/** A timer that aborts `signal` when it fires; `cancel` stops it. */
export interface Timer {
  signal: AbortSignal;
  cancel(): void;
}

/** Time as the retry policy sees it. Injected, so tests are exact and fast. */
export interface Clock {
  /** Monotonic milliseconds (`performance.now()`), immune to wall-clock changes. */
  now(): number;
  /** Milliseconds since the epoch, for HTTP-date `Retry-After` values. */
  epochNow(): number;
  sleep(ms: number, signal?: AbortSignal): Promise<void>;
  /** A wall-clock timer; its signal aborts with a timeout reason after `ms`. */
  timer(ms: number): Timer;
}

/** The real clock. */
export const systemClock: Clock = {
  now: () => performance.now(),
  epochNow: () => Date.now(),
  sleep,
  timer(ms) {
    const controller = new AbortController();
    const id = setTimeout(() => controller.abort(new DOMException(`timed out after ${ms} ms`, "TimeoutError")), ms);
    return { signal: controller.signal, cancel: () => clearTimeout(id) };
  },
};
