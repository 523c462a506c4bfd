/**
 * The validation Workers as a pool that a flood cannot grow: validations that
 * need a Worker are capped per tenant and in all (past a cap, `ValidationBusy`
 * at once, nothing queued), a Worker terminated in the middle of a validation
 * keeps its place until it has finished (Deno 2.9.6 does not stop a busy
 * thread), and a pattern V8 would backtrack on for ever answers at once, in
 * the caller's thread and on a Worker.
 */
import assert from "node:assert/strict";
import { createSchemaValidators, ValidationBusy, ValidationTimeout } from "../../src/tasks/validator.ts";
import { waitFor } from "../_support.ts";

const ITEMS = { type: "array", items: { type: "object", properties: { a: { type: "string" } }, required: ["a"] } };
/** A validation of a hundred milliseconds or so on a Worker (about 0.16 million units, under its bound). */
const MANY = Array.from({ length: 12_000 }, () => ({ a: "x" }));
const HOSTILE = { type: "string", pattern: `^${"\\d*".repeat(10)}x` };

Deno.test("validations that need a Worker are capped per tenant and in all; past a cap they fail at once", async () => {
  // A deadline far past what MANY takes, even on a loaded machine: this is about the caps, not the deadline.
  const validators = createSchemaValidators({
    workers: 1,
    fastPathUnits: 0,
    maxPendingPerTenant: 2,
    maxPending: 3,
    deadlineMs: 10_000,
  });
  try {
    const a = [validators.validate("a/t/1/input", ITEMS, MANY), validators.validate("a/t/1/input", ITEMS, [])];
    await assert.rejects(validators.validate("a/t/1/input", ITEMS, []), (error: unknown) => {
      assert.ok(error instanceof ValidationBusy);
      assert.match(error.message, /2 of this tenant's; at most 2/);
      assert.equal(error.retryAfterS, 1);
      return true;
    });
    // Another tenant still has room, until the pool as a whole is full.
    const b = validators.validate("b/t/1/input", ITEMS, []);
    await assert.rejects(validators.validate("c/t/1/input", ITEMS, []), /3 in all; at most 3/);
    assert.equal(validators.pool().pending, 3, "the refused ones were never queued");
    for (const answer of await Promise.all([...a, b])) assert.deepEqual(answer, []);
    assert.equal(validators.pool().pending, 0);
    assert.deepEqual(await validators.validate("a/t/1/input", ITEMS, [{}]), [
      { pointer: "/0", message: 'Instance does not have required property "a".' },
    ]);
  } finally {
    await validators.close();
  }
});

Deno.test("a Worker terminated in the middle of a validation counts against the pool until it has finished", async () => {
  // A deadline the Worker begins within, and the validation outlasts.
  const validators = createSchemaValidators({ workers: 1, fastPathUnits: 0, deadlineMs: 20 });
  try {
    // Started and compiled, so the next validation is timed from its first step.
    assert.deepEqual(await validators.validate("a/t/1/input", ITEMS, []), []);
    await assert.rejects(validators.validate("a/t/1/input", ITEMS, MANY), ValidationTimeout);
    // Terminated, it goes on with the validation all the same: it still takes the pool's one place.
    assert.deepEqual(validators.pool(), { workers: 0, orphans: 1, pending: 0 });
    const next = validators.validate("b/t/1/input", ITEMS, []);
    assert.deepEqual(validators.pool(), { workers: 0, orphans: 1, pending: 1 }, "no second Worker meanwhile");
    // Once it has finished, a fresh Worker takes the place and answers.
    assert.deepEqual(await next, []);
    await waitFor("the pool to hold one Worker and no orphan", () => {
      const pool = validators.pool();
      return pool.workers === 1 && pool.orphans === 0;
    });
  } finally {
    await validators.close();
  }
});

Deno.test("a pattern V8 would backtrack on for ever validates at once, in this thread and on a Worker", async () => {
  const here = createSchemaValidators();
  const onWorker = createSchemaValidators({ fastPathUnits: 0 });
  try {
    for (const validators of [here, onWorker]) {
      const started = performance.now();
      // (A schema stored before the shape check existed: validators compile what is stored as stored.)
      assert.deepEqual(await validators.validate("a/hostile/1/input", HOSTILE, "1".repeat(200)), [
        { pointer: "", message: "String does not match pattern." },
      ]);
      assert.deepEqual(await validators.validate("a/hostile/1/input", HOSTILE, `${"1".repeat(200)}x`), []);
      // Not a speed check: on V8 30 digits took 2.7 s, and 200 would never end.
      assert.ok(performance.now() - started < 1_000);
    }
    assert.equal(here.pool().workers, 0, "small enough for the caller's thread");
    assert.equal(onWorker.pool().workers, 1);
  } finally {
    await here.close();
    await onWorker.close();
  }
});
