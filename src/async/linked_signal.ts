/**
 * A signal that aborts when any of `signals` does, with that one's reason, for as long as it stays linked:
 * `unlink` (called once the operation it was made for is over) leaves nothing of it on any of `signals`.
 *
 * `AbortSignal.any` cannot be told that an operation is over. A signal it makes that has an `abort` listener
 * (`fetch` adds one, the `openai` SDK adds one it never removes) stays reachable from every source that can still
 * abort, as the spec requires, with everything its listeners hold: in Deno 2.9.6, combining a process's stop
 * signal with each call's kept every call's signal and the call's own objects for the life of the process (what
 * that held a call is in the README, "A leak" under "Per-job cost of the worker (issue 26)").
 */
export function linkedSignal(...signals: AbortSignal[]): { signal: AbortSignal; unlink(): void } {
  const controller = new AbortController();
  const aborted = signals.find((source) => source.aborted);
  if (aborted) {
    controller.abort(aborted.reason);
    return { signal: controller.signal, unlink: () => {} };
  }
  const listeners = signals.map((source) => () => {
    controller.abort(source.reason);
    unlink();
  });
  const unlink = () => signals.forEach((source, i) => source.removeEventListener("abort", listeners[i]!));
  signals.forEach((source, i) => source.addEventListener("abort", listeners[i]!, { once: true }));
  return { signal: controller.signal, unlink };
}
