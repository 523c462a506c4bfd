/**
 * What the validators (`validator.ts`) and their Workers (`validation_worker.ts`) say to each other, beyond what
 * every pool says (`_pool_worker.ts`). A module of its own, so that the starting side does not load the Worker's
 * module.
 */
import type { SchemaViolation } from "./json_schema.ts";

/** The pool's `init` options: the bounds of the cache and of a validation's work. */
export interface ValidationInit {
  cacheSize: number;
  cacheBytes: number;
  workerUnits: number;
}

/**
 * One validation. `schema` is absent when the starting side believes this Worker has compiled `key`; `instance`
 * is absent when the schema is only to be compiled (answered `result` with no violations).
 */
export interface ValidateMessage {
  id: number;
  key: string;
  schema?: unknown;
  instance?: unknown;
}

/**
 * The Worker's answers. `costly`: estimated past `workerUnits`, not run; `refused`: `compileSchema` refused the
 * schema (a `SchemaRefused`).
 */
export type ValidationReply =
  | { type: "compiled"; id: number }
  | { type: "result"; id: number; violations: SchemaViolation[] }
  | { type: "costly"; id: number }
  | { type: "missing"; id: number }
  | { type: "refused"; id: number; pointer: string; reason: string }
  | { type: "failed"; id: number; name: string; message: string };
