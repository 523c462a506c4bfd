/**
 * The Web Worker that validates instances against schemas whose work has no
 * useful bound (see `validator.ts`): the thread that started it enforces the
 * deadline and terminates it when a validation runs over. It compiles each
 * schema once per key into an LRU cache of the same capacity as the
 * starting side's record of the keys it has sent, so a schema crosses the
 * channel only the first time (again after an eviction; a `missing` reply
 * asks for it should the two ever disagree). It says `compiled` before it
 * validates with a schema it has just compiled: the deadline starts then.
 */
import { type CompiledSchema, compileSchema, type SchemaViolation } from "./json_schema.ts";
import { Lru } from "./_lru.ts";

/** The first message: the size of the cache. The worker answers `{ type: "ready" }`. */
export interface InitMessage {
  type: "init";
  cacheSize: number;
}

/** One validation. `schema` is absent when the starting side believes this worker has compiled `key`. */
export interface ValidateMessage {
  type: "validate";
  id: number;
  key: string;
  schema?: unknown;
  instance: unknown;
}

/** The worker's answers. */
export type WorkerReply =
  | { type: "ready" }
  | { type: "compiled"; id: number }
  | { type: "result"; id: number; violations: SchemaViolation[] }
  | { type: "missing"; id: number }
  | { type: "failed"; id: number; name: string; message: string };

interface WorkerScope {
  onmessage: ((event: MessageEvent<InitMessage | ValidateMessage>) => void) | null;
  postMessage(message: WorkerReply): void;
}

const scope = globalThis as unknown as WorkerScope;
let cache: Lru<string, CompiledSchema> | undefined;

scope.onmessage = ({ data }) => {
  if (data.type === "init") {
    cache = new Lru(data.cacheSize);
    scope.postMessage({ type: "ready" });
    return;
  }
  const { id, key, schema, instance } = data;
  try {
    let compiled = cache!.get(key);
    if (!compiled) {
      if (schema === undefined) return scope.postMessage({ type: "missing", id });
      compiled = compileSchema(schema);
      cache!.set(key, compiled);
      scope.postMessage({ type: "compiled", id });
    }
    scope.postMessage({ type: "result", id, violations: compiled.validate(instance) });
  } catch (error) {
    const { name, message } = error instanceof Error ? error : new Error(String(error));
    scope.postMessage({ type: "failed", id, name, message });
  }
};
