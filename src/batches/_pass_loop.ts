/** The loop of a batch service: a pass, then a pause, until stopped; a failed pass (already logged) waits too. */
import { sleep } from "../async/timeout.ts";

/** Runs `pass` every `ms` until `signal` aborts; the pass in progress finishes first. */
export async function passEvery(ms: number, signal: AbortSignal, pass: () => Promise<unknown>): Promise<void> {
  while (!signal.aborted) {
    await pass().catch(() => {});
    await sleep(ms, signal).catch(() => {});
  }
}
