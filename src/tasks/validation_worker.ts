/**
 * The Web Worker that validates instances against schemas whose work has no
 * useful bound in the caller's thread, or that are too large to compile there
 * (see `validator.ts`). It estimates each validation first and refuses one
 * past `workerUnits` without running it: the pool terminates a Worker whose
 * validation runs over the deadline, but in Deno 2.9.6 that stops it only
 * once the validation ends, so the estimate is what bounds how long it runs.
 *
 * It compiles each schema once per key into an LRU cache of the same capacity
 * (and a bound on its bytes) as the starting side's record of the keys it has
 * sent, so a schema crosses the channel only the first time (again after an
 * eviction; a `missing` reply asks for it should the two ever disagree). It
 * says `compiled` before it validates with a schema it has just compiled: the
 * deadline starts then.
 */
import { compileSchema, SchemaRefused, ValidationTooDeep } from "./json_schema.ts";
import { Lru } from "./_lru.ts";
import { costed, type CostedSchema, estimate } from "./validation_cost.ts";
import { serveWorker } from "./_pool_worker.ts";
import type { ValidateMessage, ValidationInit, ValidationReply } from "./_validation_protocol.ts";

let cache: Lru<string, CostedSchema> | undefined;
let workerUnits = 0;

serveWorker<ValidateMessage>((options) => {
  const init = options as unknown as ValidationInit;
  cache = new Lru(init.cacheSize, { maxWeight: init.cacheBytes, weigh: (entry) => entry.compiled.weight });
  workerUnits = init.workerUnits;
  warmUp();
}, ({ id, key, schema, instance }, post): ValidationReply => {
  try {
    let entry = cache!.get(key);
    if (!entry) {
      if (schema === undefined) return { type: "missing", id };
      entry = costed(schema, compileSchema(schema, { stored: true }));
      cache!.set(key, entry);
      post({ type: "compiled", id } satisfies ValidationReply);
    }
    if (instance === undefined) return { type: "result", id, violations: [] };
    if (estimate(entry, instance, workerUnits) > workerUnits) return { type: "costly", id };
    return { type: "result", id, violations: entry.compiled.validate(instance) };
  } catch (error) {
    if (error instanceof SchemaRefused) return { type: "refused", id, pointer: error.pointer, reason: error.reason };
    if (error instanceof ValidationTooDeep) return { type: "costly", id };
    const { name, message } = error instanceof Error ? error : new Error(String(error));
    return { type: "failed", id, name, message };
  }
});

/**
 * Runs a few validations of the costly kind (a pattern of Unicode classes under counted repetitions over a long
 * string) before the child says `ready`: its first validations otherwise run on code V8 has not optimised yet,
 * and a flood's first answers are the ones that run over their deadline (see README, "Hostile tenants").
 */
function warmUp(): void {
  const schema = {
    type: "object",
    properties: { code: { type: "string", pattern: "[\\p{L}\\p{N}]{0,20}".repeat(3) + "x?$" }, n: { type: "integer" } },
    required: ["code"],
  };
  const entry = costed(schema, compileSchema(schema, { stored: true }));
  for (let i = 0; i < 30; i++) {
    const instance = { code: "7".repeat(300), n: i };
    if (estimate(entry, instance, workerUnits) <= workerUnits) entry.compiled.validate(instance);
  }
}
