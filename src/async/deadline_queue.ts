/**
 * Many deadlines of one length, on one timer. Deadlines of equal length
 * expire in the order they were set, so they form a queue, and a single timer
 * armed for the oldest one serves them all: setting one costs a small object,
 * not a timer (a timer per request body showed in a `--cpu-prof` of the API
 * under load as the creation of node-compatible `Timeout` objects; its share
 * is in the README, "Intake against both baselines, its profile, and all
 * cores (issue 26)").
 */

/** A deadline that is set; the queue clears it once the work it bounds is done. */
export interface Deadline {
  readonly at: number;
}

interface Entry extends Deadline {
  at: number;
  onLate: (() => void) | undefined;
  prev: Entry | undefined;
  next: Entry | undefined;
}

/** Sets deadlines `ms` from now; each calls its `onLate` once when it passes before it is cleared. */
export interface DeadlineQueue {
  set(onLate: () => void): Deadline;
  /** Clears a deadline that has not passed: its `onLate` is never called. Clearing twice, or late, does nothing. */
  clear(deadline: Deadline): void;
  /** Deadlines set and not yet passed or cleared. */
  readonly size: number;
}

/** A queue of `ms`-long deadlines on the monotonic clock `now` (for tests). */
export function createDeadlineQueue(ms: number, now: () => number = () => performance.now()): DeadlineQueue {
  let head: Entry | undefined;
  let tail: Entry | undefined;
  let size = 0;
  let timer: ReturnType<typeof setTimeout> | undefined;
  let armedFor = Infinity;

  const unlink = (entry: Entry) => {
    if (entry.prev) entry.prev.next = entry.next;
    else head = entry.next;
    if (entry.next) entry.next.prev = entry.prev;
    else tail = entry.prev;
    entry.prev = entry.next = undefined;
    size--;
  };
  const arm = () => {
    // A timer armed for an older deadline (one since cleared) fires early and arms again; one left armed when
    // the queue empties fires for nothing. Either costs less than a timer per deadline, and it is unref'd:
    // only the work it bounds keeps the process alive.
    if (!head || (timer !== undefined && armedFor <= head.at)) return;
    if (timer !== undefined) clearTimeout(timer);
    armedFor = head.at;
    timer = setTimeout(fire, Math.max(0, head.at - now()));
    Deno.unrefTimer(timer);
  };
  const fire = () => {
    timer = undefined;
    armedFor = Infinity;
    const t = now();
    while (head && head.at <= t) {
      const entry = head;
      const onLate = entry.onLate!;
      entry.onLate = undefined;
      unlink(entry);
      onLate();
    }
    arm();
  };

  return {
    set(onLate) {
      const entry: Entry = { at: now() + ms, onLate, prev: tail, next: undefined };
      if (tail) tail.next = entry;
      else head = entry;
      tail = entry;
      size++;
      arm();
      return entry;
    },
    clear(deadline) {
      const entry = deadline as Entry;
      if (entry.onLate === undefined) return;
      entry.onLate = undefined;
      unlink(entry);
    },
    get size() {
      return size;
    },
  };
}
