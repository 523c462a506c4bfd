/**
 * What the validators (`validator.ts`) and their Workers (`validation_worker.ts`) say to each other, and the
 * state they share. A module of its own, so that the starting side does not load the Worker's module.
 */
import type { SchemaViolation } from "./json_schema.ts";

/**
 * A Worker's state, element 0 of an Int32Array both sides share. The Worker goes from `idle` to `busy` to begin
 * a validation and back when it is done; the starting side, when it terminates the Worker, from `idle` to
 * `cancelled`. Both by compare-and-exchange: a validation the Worker had not begun then, it never begins; one
 * it had, the starting side sees as `busy`.
 */
export const WORKER_STATE = { idle: 0, busy: 1, cancelled: 2 } as const;

/** The first message: the bounds of the cache and of a validation's work, the state. Answered `ready`. */
export interface InitMessage {
  type: "init";
  cacheSize: number;
  cacheBytes: number;
  workerUnits: number;
  /** The buffer of the shared {@linkcode WORKER_STATE}. */
  state: SharedArrayBuffer;
}

/** One validation. `schema` is absent when the starting side believes this worker has compiled `key`. */
export interface ValidateMessage {
  type: "validate";
  id: number;
  key: string;
  schema?: unknown;
  instance: unknown;
}

/** The worker's answers. `costly`: estimated past `workerUnits`, not run. */
export type WorkerReply =
  | { type: "ready" }
  | { type: "compiled"; id: number }
  | { type: "result"; id: number; violations: SchemaViolation[] }
  | { type: "costly"; id: number }
  | { type: "missing"; id: number }
  | { type: "failed"; id: number; name: string; message: string };
