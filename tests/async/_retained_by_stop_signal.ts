/**
 * Run by `linked_signal_test.ts` with `--v8-flags=--expose-gc`: makes CALLS calls through one of the service's
 * paths that combine a long-lived stop signal with a call's own, each call's signal given an `abort` listener
 * that holds 16 KB of heap and is never removed (as the `openai` SDK's is), then prints how much the heap grew,
 * in MB, after a full collection. `any`: `AbortSignal.any` itself, for comparison.
 * Usage: _retained_by_stop_signal.ts retry|mail|any CALLS
 */
import { callWithRetries } from "../../src/retry/retry_policy.ts";
import { createResendMailer } from "../../src/mail/resend_mailer.ts";
import { Deadline } from "../../src/retry/deadline.ts";

const [path, callsArg] = Deno.args;
const calls = Number(callsArg);
const stop = new AbortController(); // lives as long as the process, as a worker's or a relay's does
const gc = (globalThis as unknown as { gc(): void }).gc;

/** What the SDK and fetch do with a call's signal: listen, and never stop listening. */
function listen(signal: AbortSignal | null | undefined) {
  const held = Array.from({ length: 2048 }, (_, i) => i * 0.5); // 16 KB of doubles on the heap
  signal?.addEventListener("abort", () => held.length);
}

const mailer = createResendMailer({
  apiKey: "re_test",
  baseUrl: "http://127.0.0.1:1",
  timeoutMs: 60_000,
  fetch: (_url, init) => {
    listen(init?.signal);
    return Promise.resolve(new Response('{"id":"x"}', { status: 200 }));
  },
});
const email = { from: "a@example.com", to: ["b@example.com"], subject: "s", text: "t" };

async function once(i: number) {
  if (path === "retry") {
    await callWithRetries((signal) => Promise.resolve(listen(signal)), {
      deadline: Deadline.after(60_000),
      perCallTimeoutMs: 60_000,
      maxAttempts: 1,
      signal: stop.signal,
    });
  } else if (path === "mail") {
    await mailer.send(email, `key-${i}`, stop.signal);
  } else {
    listen(AbortSignal.any([new AbortController().signal, stop.signal]));
  }
}

gc();
const before = Deno.memoryUsage().heapUsed;
for (let i = 0; i < calls; i++) await once(i);
await new Promise((resolve) => setTimeout(resolve, 50));
gc();
console.log(((Deno.memoryUsage().heapUsed - before) / 1e6).toFixed(1));
