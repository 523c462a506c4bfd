/**
 * `Prefer: wait=N`: requests that wait for a job to finish are woken by the
 * finish itself, not by polling. Every outcome committed to `job_outcomes`
 * (done or cancelled) NOTIFYs `oncely_jobs` with the job id from a trigger,
 * and a worker that dead-letters a job NOTIFYs the same channel. One LISTEN
 * connection per API process serves every waiting request.
 */
import type { Sql } from "postgres";
import type { Logger } from "../log/logger.ts";
import { sleep } from "../async/timeout.ts";

/** The channel job outcomes are announced on (see migrations/004). */
export const JOBS_CHANNEL = "oncely_jobs";

/** The most seconds a client may ask to wait (`Prefer: wait=N`). */
export const MAX_WAIT_S = 60;

/** A waiter's interest in one job: `next` resolves on the job's next notification, or after `ms`. */
export interface JobSubscription {
  /** @returns true when woken by a notification, false on timeout or abort. */
  next(ms: number, signal?: AbortSignal): Promise<boolean>;
  close(): void;
}

/** The process's one listener. */
export interface JobWaiter {
  /** Register before checking the job's status, so a finish between the check and the wait is not missed. */
  subscribe(jobId: string): JobSubscription;
  /** Whether the listener is connected; without it, waits are not offered. */
  readonly listening: boolean;
  close(): Promise<void>;
}

/** Tells waiting requests that `jobId` changed (a dead letter; commits and cancels notify from a trigger). */
export async function notifyJob(sql: Sql, jobId: string): Promise<void> {
  await sql.notify(JOBS_CHANNEL, jobId);
}

/** Starts listening on `oncely_jobs`. postgres.js reconnects a dropped listener; every waiter re-checks then. */
export async function createJobWaiter({ sql, log }: { sql: Sql; log: Logger }): Promise<JobWaiter> {
  const waiting = new Map<string, Set<() => void>>();
  let listening = false;
  const wakeAll = () => {
    for (const wakers of waiting.values()) for (const wake of wakers) wake();
  };
  const listener = await sql.listen(
    JOBS_CHANNEL,
    (jobId) => {
      for (const wake of waiting.get(jobId) ?? []) wake();
    },
    () => {
      // (Re)connected: anything announced while we were away was missed, so everyone looks again.
      if (listening) log.info("job_listener_reconnected");
      listening = true;
      wakeAll();
    },
  );
  // postgres.js resolves once the LISTEN is in place (the first onlisten may come before or after).
  listening = true;
  return {
    get listening() {
      return listening;
    },
    subscribe(jobId) {
      let pending = false;
      let wake: (() => void) | undefined;
      const waker = () => {
        pending = true;
        wake?.();
      };
      const set = waiting.get(jobId) ?? new Set();
      set.add(waker);
      waiting.set(jobId, set);
      return {
        next(ms, signal) {
          if (pending) {
            pending = false;
            return Promise.resolve(true);
          }
          return new Promise<boolean>((resolve) => {
            const done = (woken: boolean) => {
              clearTimeout(timer);
              signal?.removeEventListener("abort", onAbort);
              wake = undefined;
              pending = false;
              resolve(woken);
            };
            const onAbort = () => done(false);
            const timer = setTimeout(() => done(false), Math.max(0, ms));
            wake = () => done(true);
            if (signal?.aborted) done(false);
            else signal?.addEventListener("abort", onAbort, { once: true });
          });
        },
        close() {
          wake = undefined;
          set.delete(waker);
          if (set.size === 0 && waiting.get(jobId) === set) waiting.delete(jobId);
        },
      };
    },
    async close() {
      listening = false;
      wakeAll();
      await listener.unlisten();
    },
  };
}

/**
 * A waiter that connects in the background and keeps trying every 5 s until
 * it listens (or `signal` aborts): an API started while Postgres is down
 * serves at once, and offers waits once the listener is up.
 */
export function startJobWaiter({ sql, log }: { sql: Sql; log: Logger }, signal: AbortSignal): JobWaiter {
  let inner: JobWaiter | undefined;
  const connecting = (async () => {
    while (!signal.aborted) {
      try {
        inner = await createJobWaiter({ sql, log });
        return;
      } catch (error) {
        log.warn("job_listener_unavailable", { error, retry_in_ms: 5_000 });
        await sleep(5_000, signal).catch(() => {});
      }
    }
  })();
  return {
    get listening() {
      return inner?.listening ?? false;
    },
    subscribe(jobId) {
      if (!inner) throw new Error("the job listener is not connected");
      return inner.subscribe(jobId);
    },
    async close() {
      await connecting;
      await inner?.close();
    },
  };
}

/**
 * The `wait` preference of a request (RFC 7240), capped at {@linkcode MAX_WAIT_S};
 * undefined when absent, zero or malformed (a preference the server may ignore).
 */
export function preferredWaitS(headers: Headers, maxS: number = MAX_WAIT_S): number | undefined {
  const prefer = headers.get("prefer");
  if (!prefer) return undefined;
  for (const preference of prefer.split(",")) {
    const [token] = preference.split(";");
    const match = /^\s*wait\s*=\s*"?(\d{1,9})"?\s*$/i.exec(token ?? "");
    if (!match) continue;
    const seconds = Math.min(Number(match[1]), maxS);
    return seconds > 0 ? seconds : undefined;
  }
  return undefined;
}
