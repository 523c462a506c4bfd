/**
 * Issue 37's last findings on the Worker pools: a schema too large to compile
 * quickly is compiled on a Worker only (a run's input schema at its first
 * intake was compiled on the API's serving thread: 42-67 ms for the largest),
 * a stored schema this release refuses is found there too, `prepare` compiles
 * a run's output schema once however many runs ask at once, and the
 * definition checker counts a Worker terminated mid-check against its pool
 * and caps each tenant's checks.
 */
import assert from "node:assert/strict";
import { compileSchema, SchemaRefused } from "../../src/tasks/json_schema.ts";
import { createSchemaValidators, VALIDATION_LIMITS } from "../../src/tasks/validator.ts";
import {
  createDefinitionChecker,
  DefinitionCheckBusy,
  DefinitionCheckTimeout,
} from "../../src/tasks/definition_checker.ts";
import { heavyDefinition, smallDefinition, wideSchema } from "../support/task_definitions.ts";
import { thisThread, threadsCpuMs } from "../support/threads.ts";
import { waitFor } from "../_support.ts";
import { createWorkerPool, type WorkerPoolOptions } from "../../src/tasks/worker_pool.ts";

const WIDE = wideSchema();
/** An instance of WIDE: every field's object. */
const WIDE_VALUE = Object.fromEntries(Object.keys(WIDE.properties as object).map((name) => [name, { a: "x", b: 1 }]));
/** A schema over the thread's size bound whose pattern RE2 cannot run (a count over 1,000), as an earlier release stored it. */
const REFUSED = {
  ...wideSchema(VALIDATION_LIMITS.threadSchemaBytes * 2),
  patternProperties: { "^x": { type: "string", pattern: "^.{0,5000}$" } },
};

Deno.test("a large schema is compiled on a Worker, not on the thread that asks", async () => {
  const validators = createSchemaValidators();
  try {
    assert.ok(JSON.stringify(WIDE).length > VALIDATION_LIMITS.threadSchemaBytes);
    const tid = await thisThread();
    // What compiling it costs on this thread, warmed up: what each new key would add here without the Worker.
    compileSchema(structuredClone(WIDE), { stored: true });
    let before = (await threadsCpuMs()).get(tid)!;
    for (let i = 0; i < 5; i++) compileSchema(structuredClone(WIDE), { stored: true });
    const oneCompileMs = ((await threadsCpuMs()).get(tid)! - before) / 5;
    before = (await threadsCpuMs()).get(tid)!;
    for (let i = 0; i < 8; i++) {
      // A version each, as eight new task versions' first runs would be.
      assert.equal(validators.validateNow(`acme/wide/${i}/input`, WIDE, WIDE_VALUE), undefined, "not on this thread");
      assert.deepEqual(await validators.validate(`acme/wide/${i}/input`, WIDE, WIDE_VALUE), []);
    }
    const spent = (await threadsCpuMs()).get(tid)! - before;
    assert.ok(
      spent < 8 * oneCompileMs / 2,
      `8 first validations took ${spent} ms of this thread's CPU; one compile here takes ${oneCompileMs} ms`,
    );
    // Its violations are the validator's, as on this thread.
    const wrong = await validators.validate("acme/wide/0/input", WIDE, { ...WIDE_VALUE, field_0: { a: "x" } });
    assert.equal(wrong[0]?.pointer, "/field_0");
  } finally {
    await validators.close();
  }
});

Deno.test("a large stored schema this release refuses is refused by the Worker, as a SchemaRefused, and remembered", async () => {
  const validators = createSchemaValidators({ workers: 1 });
  try {
    // Not compiled here, so not refused here either: the Worker finds out.
    assert.equal(validators.validateNow("acme/old/1/input", REFUSED, {}), undefined);
    const refusal = (error: unknown) => {
      assert.ok(error instanceof SchemaRefused, String(error));
      assert.equal(error.pointer, "/patternProperties/^x/pattern");
      assert.match(error.message, /1000|1,000|repeat/i);
      return true;
    };
    await assert.rejects(validators.validate("acme/old/1/input", REFUSED, {}), refusal);
    await assert.rejects(validators.prepare("acme/old/1/output", REFUSED), refusal);
    // Remembered: the next call is refused without a Worker.
    const again = validators.validate("acme/old/1/input", REFUSED, {});
    assert.equal(validators.pool().pending, 0);
    await assert.rejects(again, refusal);
  } finally {
    await validators.close();
  }
});

Deno.test("prepare compiles a large schema once, however many runs ask at once, and then costs nothing", async () => {
  // A cap of two per tenant: 50 callers at once would be refused, were each of them sent to a Worker.
  const validators = createSchemaValidators({ workers: 1, maxPendingPerTenant: 2 });
  try {
    await Promise.all(Array.from({ length: 50 }, () => validators.prepare("acme/wide/1/output", WIDE)));
    const later = validators.prepare("acme/wide/1/output", WIDE);
    assert.equal(validators.pool().pending, 0, "known to compile: no Worker asked");
    await later;
    // A small schema is compiled on this thread, where it is validated.
    const small = { type: "object", properties: { a: { type: "string" } } };
    const prepared = validators.prepare("acme/small/1/output", small);
    assert.equal(validators.pool().pending, 0);
    await prepared;
    assert.deepEqual(validators.validateNow("acme/small/1/output", small, { a: "x" }), []);
  } finally {
    await validators.close();
  }
});

Deno.test("a definition Worker terminated mid-check counts against the pool until the check has ended", async () => {
  // On a Web Worker, as a compiled binary checks: a child process is killed at once (below).
  const checker = createDefinitionChecker({ workers: 1, deadlineMs: 20, isolation: "thread" });
  try {
    // Loaded and warmed up, so the heavy check is under way when its deadline passes (it takes 70 ms or more).
    await checker.check(JSON.stringify(smallDefinition()), "acme");
    await assert.rejects(checker.check(JSON.stringify(heavyDefinition()), "acme"), DefinitionCheckTimeout);
    assert.deepEqual(checker.pool(), { workers: 0, orphans: 1, pending: 0 });
    const next = checker.check(JSON.stringify(smallDefinition(1)), "globex");
    assert.deepEqual(checker.pool(), { workers: 0, orphans: 1, pending: 1 }, "no second Worker meanwhile");
    await next;
    await waitFor("the pool to hold one Worker and no orphan", () => {
      const pool = checker.pool();
      return pool.workers === 1 && pool.orphans === 0;
    });
  } finally {
    await checker.close();
  }
});

Deno.test("a tenant's definition checks are capped, and another tenant's still run", async () => {
  const checker = createDefinitionChecker({ workers: 1, maxPendingPerTenant: 2, maxWaiting: 3 });
  try {
    const mine = [0, 1].map((i) => checker.check(JSON.stringify(smallDefinition(i)), "acme"));
    await assert.rejects(checker.check(JSON.stringify(smallDefinition(2)), "acme"), (error: unknown) => {
      assert.ok(error instanceof DefinitionCheckBusy);
      assert.match(error.message, /2 of this tenant's; at most 2/);
      return true;
    });
    const theirs = checker.check(JSON.stringify(smallDefinition(3)), "globex");
    await assert.rejects(checker.check(JSON.stringify(smallDefinition(4)), "initech"), /3 in all; at most 3/);
    await Promise.all([...mine, theirs]);
    assert.equal(checker.pool().pending, 0);
  } finally {
    await checker.close();
  }
});

Deno.test("a Worker that has compiled its share is stopped once its work is done, and a fresh one answers next", async () => {
  // A heap grows with what it compiles and never shrinks: a stopped Worker gives it all back.
  const validators = createSchemaValidators({ workers: 1, fastPathUnits: 0, recycleChars: 1_000 });
  const checker = createDefinitionChecker({ workers: 1, recycleChars: 1_000 });
  try {
    const big = wideSchema(1_500);
    assert.deepEqual(await validators.validate("acme/big/1/input", big, {}), [
      { pointer: "", message: 'Instance does not have required property "field_0".' },
    ]);
    assert.deepEqual(validators.pool(), { workers: 0, orphans: 0, pending: 0 }, "stopped, not orphaned");
    // Small schemas add up to the share too; until then the Worker stays.
    const small = { type: "object", properties: { a: { type: "string" } } };
    assert.deepEqual(await validators.validate("acme/small/1/input", small, { a: 1 }), [
      { pointer: "/a", message: 'Instance type "number" is invalid. Expected "string".' },
    ]);
    assert.equal(validators.pool().workers, 1);
    await checker.check(JSON.stringify(smallDefinition()), "acme");
    assert.equal(checker.pool().workers, 1, "under its share");
    await checker.check(JSON.stringify({ ...smallDefinition(1), system: "s".repeat(1_000) }), "acme");
    assert.deepEqual(checker.pool(), { workers: 0, orphans: 0, pending: 0 });
    await checker.check(JSON.stringify(smallDefinition(2)), "acme");
  } finally {
    await validators.close();
    await checker.close();
  }
});

Deno.test("validation Workers idle for idleMs are stopped", async () => {
  const validators = createSchemaValidators({ workers: 1, fastPathUnits: 0, idleMs: 50 });
  try {
    assert.deepEqual(await validators.validate("acme/t/1/input", { type: "string" }, "x"), []);
    assert.equal(validators.pool().workers, 1);
    await waitFor("the idle Worker to stop", () => validators.pool().workers === 0);
  } finally {
    await validators.close();
  }
});

/** A pool of the fixture's child processes (`tests/support/pool_fixture_worker.ts`), one at a time. */
function fixturePool(options: Partial<WorkerPoolOptions<unknown>> = {}) {
  return createWorkerPool<unknown, { id: number; done: number; length: number }>({
    url: new URL("../support/pool_fixture_worker.ts", import.meta.url).href,
    name: "fixture",
    title: "fixture",
    workers: 1,
    startMs: 10_000,
    orphanMs: 600_000,
    maxPendingPerTenant: 10,
    maxPending: 10,
    slotData: () => undefined,
    busy: (what) => new Error(`busy: ${what}`),
    isolation: "process",
    ...options,
  });
}

/** Runs `what` on the fixture under a deadline of `ms`: the child's pid (and the length of `payload` it saw). */
function fixtureRun(pool: ReturnType<typeof fixturePool>, what: string, ms = 5_000): Promise<number> {
  return fixtureAnswer(pool, what, ms).then(({ done }) => done);
}

function fixtureAnswer(pool: ReturnType<typeof fixturePool>, what: string, ms = 5_000, payload?: string) {
  return pool.run("acme", {
    begin(slot, id) {
      slot.post({ id, do: what, payload });
      slot.arm(ms);
    },
    reply: (data) => ({ value: data }),
    timedOut: (ms) => new Error(`timed out after ${ms} ms`),
  });
}

/** Whether process `pid` exists (a zombie counts: not yet reaped). */
async function alive(pid: number): Promise<boolean> {
  try {
    await Deno.stat(`/proc/${pid}`);
    return true;
  } catch {
    return false;
  }
}

Deno.test("a child process that runs over its deadline is killed mid-loop and reaped, and the next work runs on a fresh one", async () => {
  // A Worker in a loop that never ends would hold its thread for ever (Deno 2.9.6's terminate() waits for it).
  const pool = fixturePool();
  try {
    const first = await fixtureRun(pool, "echo");
    assert.notEqual(first, Deno.pid, "a process of its own");
    await assert.rejects(fixtureRun(pool, "spin", 100), /timed out after 100 ms/);
    await waitFor("the killed child to be reaped", () => pool.stats().orphans === 0, 2_000);
    assert.equal(await alive(first), false, "the spinning child is gone");
    const next = await fixtureRun(pool, "echo");
    assert.notEqual(next, first);
  } finally {
    await pool.close();
  }
});

Deno.test("a child past its heap cap ends, its work fails, and the next work gets a fresh child", async () => {
  const pool = fixturePool({ heapMiB: 64 });
  try {
    const first = await fixtureRun(pool, "echo");
    await assert.rejects(fixtureRun(pool, "grow", 20_000), /The fixture Worker failed: its process exited \(SIG/);
    assert.equal(await alive(first), false);
    assert.notEqual(await fixtureRun(pool, "echo"), first);
  } finally {
    await pool.close();
  }
});

Deno.test("close() settles once its children are reaped", async () => {
  const pool = fixturePool();
  const pid = await fixtureRun(pool, "echo");
  await pool.close();
  assert.equal(await alive(pid), false);
});

Deno.test("a child gets none of this process's environment but where Deno's cache is, so LD_* cannot stop its spawn", async () => {
  // Deno refuses to pass LD_LIBRARY_PATH to a program an --allow-run list names; a secret has no business there.
  Deno.env.set("ONCELY_TEST_SECRET", "s3cret");
  Deno.env.set("LD_LIBRARY_PATH", "/usr/lib");
  const pool = fixturePool();
  try {
    const pid = await fixtureRun(pool, "echo");
    // Deno treats /proc as privileged; `cat` reads it for us.
    const out = await new Deno.Command("cat", { args: [`/proc/${pid}/environ`], stdout: "piped" }).output();
    const environ = new TextDecoder().decode(out.stdout).split("\0").filter(Boolean);
    assert.deepEqual(environ.map((entry) => entry.split("=")[0]).filter((name) => name !== "DENO_DIR"), ["OTEL_DENO"]);
  } finally {
    Deno.env.delete("ONCELY_TEST_SECRET");
    Deno.env.delete("LD_LIBRARY_PATH");
    await pool.close();
  }
});

Deno.test("messages of megabytes cross whole, in both directions; a line that is not a message fails the child", async () => {
  const pool = fixturePool();
  try {
    // Multi-byte characters split across the pipe's pieces, and a line far longer than one piece.
    const payload = "añ€𝄞".repeat(600_000);
    assert.equal((await fixtureAnswer(pool, "echo", 20_000, payload)).length, payload.length);
    await assert.rejects(fixtureRun(pool, "print"), /its process wrote what is not a message: hello/);
    assert.equal((await fixtureAnswer(pool, "echo")).length, 0, "a fresh child answers next");
  } finally {
    await pool.close();
  }
});

Deno.test("a pool keeps `keep` children started: with the pool, past idleMs, and again once one is killed", async () => {
  const pool = fixturePool({ keep: 1, idleMs: 50 });
  try {
    await waitFor("the kept child to start", () => pool.stats().workers === 1);
    const first = await fixtureRun(pool, "echo");
    await new Promise((resolve) => setTimeout(resolve, 200));
    assert.equal(pool.stats().workers, 1, "not stopped when idle");
    assert.equal(await fixtureRun(pool, "echo"), first, "the same child");
    await assert.rejects(fixtureRun(pool, "spin", 100), /timed out/);
    // A fresh one is started without waiting for work.
    await waitFor("a fresh child", () => pool.stats().workers === 1 && pool.stats().orphans === 0);
    assert.notEqual(await fixtureRun(pool, "echo"), first);
  } finally {
    await pool.close();
  }
});

Deno.test("a kept child killed from outside is not started again at once: kept ones wait keepRetryMs, work does not", async () => {
  // A hold-off longer than the test: only work may start a child here.
  const pool = fixturePool({ keep: 1, keepRetryMs: 600_000 });
  try {
    await waitFor("the kept child to start", () => pool.stats().workers === 1);
    const first = await fixtureRun(pool, "echo");
    // Something outside the pool that killed each kept child as soon as it was up made the pool start them in a
    // loop: a fresh one was started the moment the death was seen, so the pool never held none.
    Deno.kill(first, "SIGKILL");
    await waitFor("the death to be seen, and no child started", () => {
      const { workers, orphans } = pool.stats();
      return workers === 0 && orphans === 0;
    });
    const next = await fixtureRun(pool, "echo");
    assert.notEqual(next, first, "work started a child of its own");
  } finally {
    await pool.close();
  }
});

Deno.test("kept children are started again by the pool's own timer once the hold-off after a death is over", async () => {
  const pool = fixturePool({ keep: 1, keepRetryMs: 1_000 });
  try {
    await waitFor("the kept child to start", () => pool.stats().workers === 1);
    const first = await fixtureRun(pool, "echo");
    Deno.kill(first, "SIGKILL");
    await waitFor("the death to be seen", () => pool.stats().workers === 0);
    // No work and no orphan wakes the pool: only its timer can.
    await waitFor("a kept child started again", () => pool.stats().workers === 1);
    assert.notEqual(await fixtureRun(pool, "echo"), first);
  } finally {
    await pool.close();
  }
});

Deno.test("kept children that fail to start are tried again by the pool's own timer once the hold-off is over", async () => {
  const pool = fixturePool({
    url: new URL("../support/no_such_pool_worker.ts", import.meta.url).href,
    keep: 1,
    keepRetryMs: 500,
  });
  try {
    // Started with the pool, and failed: the child cannot load its module.
    assert.equal(pool.stats().workers, 1);
    await waitFor("the failed start to be seen", () => pool.stats().workers === 0);
    // Nothing else wakes the pool: before the timer, keeping resumed only when work came.
    await waitFor("a second try, by the timer", () => pool.stats().workers === 1);
  } finally {
    await pool.close();
  }
});

Deno.test("work waiting for a Worker leaves the queue when its caller gives up; work begun runs to its deadline", async () => {
  const pool = fixturePool();
  try {
    // The one child spins until its deadline kills it.
    const spinning = fixtureRun(pool, "spin", 1_500).catch((error) => error);
    await waitFor("the spin under way", () => pool.stats().workers === 1 && pool.stats().pending === 1);
    const giveUp = new AbortController();
    const waiting = pool.run("globex", {
      begin(slot, id) {
        slot.post({ id, do: "echo" });
        slot.arm(5_000);
      },
      reply: (data) => ({ value: data }),
      timedOut: (ms) => new Error(`timed out after ${ms} ms`),
    }, giveUp.signal);
    assert.equal(pool.stats().pending, 2);
    giveUp.abort(new Error("the caller's deadline"));
    await assert.rejects(waiting, /the caller's deadline/);
    assert.equal(pool.stats().pending, 1, "no longer counted against the caps");
    assert.match(String(await spinning), /timed out after 1500 ms/, "the work begun was not cut short by it");
    // The next work gets the fresh child, and the one given up never ran.
    assert.equal(typeof await fixtureRun(pool, "echo"), "number");
    await assert.rejects(
      pool.run("acme", { begin() {}, reply: () => undefined, timedOut: () => new Error("x") }, AbortSignal.abort()),
      /abort/i,
      "a signal already aborted refuses at once",
    );
    assert.equal(pool.stats().pending, 0);
  } finally {
    await pool.close();
  }
});
