import { sleep } from "../async/timeout.ts";
import type { LaneSource } from "./lanes.ts";
import type { LaneNames } from "./message.ts";

/** Defaults of {@linkcode staticLanes}. */
export const STATIC_LANES_DEFAULTS = {
  /** With no registry to publish wake-ups, the lanes are looked at again this often while they are empty. */
  pollMs: 50,
} as const;

/**
 * A {@linkcode LaneSource} of fixed lanes, always read, with no lane
 * registry (the queue's own tests and benches): every call names them all
 * as news (they are few). New work is found by polling every `pollMs` while
 * the lanes are empty.
 */
export function staticLanes(lanes: LaneNames[], { pollMs = STATIC_LANES_DEFAULTS.pollMs } = {}): LaneSource {
  return {
    active: () => Promise.resolve([...lanes]),
    walk: () => {
      let done = false;
      return {
        next: () => {
          const batch = { lanes: done ? [] : [...lanes], done: true };
          done = true;
          return Promise.resolve(batch);
        },
      };
    },
    idle: () => Promise.resolve([]),
    wait: (ms) => sleep(Math.min(ms, pollMs)),
  };
}
