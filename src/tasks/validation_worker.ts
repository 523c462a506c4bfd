/**
 * The Web Worker that validates instances against schemas whose work has no
 * useful bound in the caller's thread (see `validator.ts`). It estimates each
 * validation first and refuses one past `workerUnits` without running it: the
 * thread that started it terminates it when a validation runs over the
 * deadline, but in Deno 2.9.6 that stops it only once the validation ends,
 * so the estimate is what bounds how long it runs. Its state in shared
 * memory says whether it is validating: the starting side counts a
 * terminated Worker against its pool until it is not.
 *
 * It compiles each schema once per key into an LRU cache of the same capacity
 * (and a bound on its bytes) as the starting side's record of the keys it has sent, so a schema crosses
 * the channel only the first time (again after an eviction; a `missing` reply
 * asks for it should the two ever disagree). It says `compiled` before it
 * validates with a schema it has just compiled: the deadline starts then.
 */
import { compileSchema } from "./json_schema.ts";
import { Lru } from "./_lru.ts";
import { costed, type CostedSchema, estimate } from "./validation_cost.ts";
import { type InitMessage, type ValidateMessage, WORKER_STATE, type WorkerReply } from "./_validation_protocol.ts";

interface WorkerScope {
  onmessage: ((event: MessageEvent<InitMessage | ValidateMessage>) => void) | null;
  postMessage(message: WorkerReply): void;
}

const scope = globalThis as unknown as WorkerScope;
let cache: Lru<string, CostedSchema> | undefined;
let workerUnits = 0;
let state: Int32Array | undefined;

scope.onmessage = ({ data }) => {
  if (data.type === "init") {
    cache = new Lru(data.cacheSize, { maxWeight: data.cacheBytes, weigh: (entry) => entry.compiled.weight });
    workerUnits = data.workerUnits;
    state = new Int32Array(data.state);
    scope.postMessage({ type: "ready" });
    return;
  }
  const { id, key, schema, instance } = data;
  // Terminated before it began: it must not begin now, unseen.
  if (Atomics.compareExchange(state!, 0, WORKER_STATE.idle, WORKER_STATE.busy) !== WORKER_STATE.idle) return;
  try {
    let entry = cache!.get(key);
    if (!entry) {
      if (schema === undefined) return scope.postMessage({ type: "missing", id });
      entry = costed(schema, compileSchema(schema, { stored: true }));
      cache!.set(key, entry);
      scope.postMessage({ type: "compiled", id });
    }
    if (estimate(entry, instance, workerUnits) > workerUnits) return scope.postMessage({ type: "costly", id });
    scope.postMessage({ type: "result", id, violations: entry.compiled.validate(instance) });
  } catch (error) {
    const { name, message } = error instanceof Error ? error : new Error(String(error));
    scope.postMessage({ type: "failed", id, name, message });
  } finally {
    // Last: the starting side may count this Worker as free of its validation from now on.
    Atomics.store(state!, 0, WORKER_STATE.idle);
  }
};
