/**
 * Validation with a bound on its work: small validations of schemas without
 * costly keywords in the caller's thread, everything else on Web Workers
 * under a deadline, with the same violations as `compileSchema(...).validate`;
 * a slow validation times out without stalling the caller and the next
 * validation gets a fresh Worker; one estimated past the Worker's bound does
 * not run; tenants waiting for a Worker are served in turn; compiled schemas
 * are cached per key; and the api command's permission set lets its process
 * start the Worker.
 */
import assert from "node:assert/strict";
import { compileSchema, SchemaRefused } from "../../src/tasks/json_schema.ts";
import { createSchemaValidators, ValidationTimeout, ValidationTooCostly } from "../../src/tasks/validator.ts";
import { permissionFlags } from "../../src/permissions.ts";
import { parseConfig } from "../../src/config.ts";

const ROOT = decodeURIComponent(new URL("../..", import.meta.url).pathname);
const MIGRATIONS = decodeURIComponent(new URL("../../migrations/", import.meta.url).pathname);

const TICKET = {
  type: "object",
  properties: {
    body: { type: "string", maxLength: 200 },
    customer: { type: "object", properties: { name: { type: "string" }, tier: { enum: ["free", "pro"] } } },
    tags: { type: "array", items: { type: "string" }, maxItems: 5 },
  },
  required: ["body"],
  additionalProperties: false,
};
const TICKETS: unknown[] = [
  { body: "The invoice is wrong.", customer: { name: "Ada", tier: "pro" }, tags: ["billing"] },
  { body: "x".repeat(201) },
  { body: "Hi", customer: { name: "Ada", tier: "gold" } },
  { body: "Hi", tags: ["a", 2] },
  { customer: { name: "Ada" } },
  { body: "Hi", extra: true },
  [],
];

/** A pattern that backtracked cubically on a run of digits when it ran on V8 (a stored schema may hold it). */
const CUBIC = { type: "string", pattern: "^\\d+\\d+\\d+$" };

/** A validation that goes to a Worker and takes some tens of milliseconds there: 15,000 tickets. */
const TICKETS_SCHEMA = { type: "array", items: TICKET };
const MANY_TICKETS = Array.from({ length: 15_000 }, () => TICKETS[0]);

/** No costly keyword, but each level evaluates both branches on the next: 2^depth evaluations. */
const FAN_OUT = { anyOf: [{ properties: { a: { $ref: "#" } } }, { properties: { a: { $ref: "#" } } }] };
const nested = (depth: number): unknown => (depth === 0 ? {} : { a: nested(depth - 1) });

/** Whether `promise` settles before any task runs, so before a Worker could have answered. */
async function settlesInThisTurn(promise: Promise<unknown>): Promise<boolean> {
  let settled = false;
  promise.then(() => (settled = true), () => (settled = true));
  for (let i = 0; i < 10; i++) await Promise.resolve();
  return settled;
}

Deno.test("a small validation of a schema without costly keywords answers in the caller's thread", async () => {
  const validators = createSchemaValidators();
  try {
    const compiled = compileSchema(structuredClone(TICKET));
    for (const ticket of TICKETS) {
      const answer = validators.validate("acme/ticket/1/input", TICKET, ticket);
      assert.ok(await settlesInThisTurn(answer), JSON.stringify(ticket));
      assert.deepEqual(await answer, compiled.validate(ticket));
    }
    assert.deepEqual(await validators.validate("acme/ticket/1/input", TICKET, TICKETS[0]), []);
    assert.equal((await validators.validate("acme/ticket/1/input", TICKET, TICKETS[1])).length, 1);
  } finally {
    await validators.close();
  }
});

Deno.test("a costly keyword under a property named like a keyword still goes to a Worker", () => {
  const validators = createSchemaValidators();
  try {
    for (const name of ["default", "enum", "const", "examples", "required"]) {
      const schema = { type: "object", properties: { [name]: { type: "array", uniqueItems: true } } };
      assert.equal(validators.validateNow(`acme/${name}/1/input`, schema, { [name]: [1, 2] }, 5), undefined, name);
    }
    const uniqueInDefs = { $defs: { default: { type: "array", uniqueItems: true } }, $ref: "#/$defs/default" };
    assert.equal(validators.validateNow("acme/defs/1/input", uniqueInDefs, [1, 2], 3), undefined);
    // Without a costly keyword, the same shape stays on the fast path.
    const plain = { type: "object", properties: { default: { type: "string", maxLength: 3 } } };
    assert.deepEqual(validators.validateNow("acme/plain/1/input", plain, { default: "abc" }, 5), []);
  } finally {
    void validators.close();
  }
});

Deno.test("on a Worker, validations give compileSchema's violations", async () => {
  // What this checks is the answer, not the time: generous deadlines, so a loaded machine (CI beside other
  // processes) cannot turn a slow Worker start into a ValidationTimeout. The deadline has tests of its own below.
  const slack = { deadlineMs: 10_000, compileMs: 10_000, startMs: 30_000 };
  const validators = createSchemaValidators(slack);
  const everything = createSchemaValidators({ ...slack, fastPathUnits: 0 });
  try {
    const withPattern = {
      ...TICKET,
      properties: { ...TICKET.properties, body: { type: "string", maxLength: 200, pattern: "^[A-Z]" } },
    };
    const many = Array.from({ length: 3_000 }, () => TICKETS[0]);
    const cases: [unknown, unknown[], ReturnType<typeof createSchemaValidators>][] = [
      // A pattern (run on RE2 on both sides).
      [withPattern, [...TICKETS, { body: "lower case" }], everything],
      // Any schema does when the estimate is over the budget (here 0).
      [TICKET, TICKETS, everything],
      // A large instance: 3,000 tickets, the last one without a body.
      [{ type: "array", items: TICKET }, [many, [...many, TICKETS[4]]], validators],
    ];
    for (const [i, [schema, instances, on]] of cases.entries()) {
      const compiled = compileSchema(structuredClone(schema));
      for (const instance of instances) {
        const answer = on.validate(`acme/case-${i}/1/input`, schema, instance);
        assert.equal(await settlesInThisTurn(answer), false, "went to a Worker");
        assert.deepEqual(await answer, compiled.validate(instance));
      }
    }
    await assert.rejects(validators.validate("acme/bad/1/input", { type: "strin" }, "x"), SchemaRefused);
  } finally {
    await validators.close();
    await everything.close();
  }
});

Deno.test("a slow validation times out in the deadline, without stalling the caller, and a fresh Worker answers next", async () => {
  const validators = createSchemaValidators({ workers: 1, deadlineMs: 5 });
  try {
    // The Worker is started and has compiled the schema, so what follows measures the validation itself.
    assert.deepEqual(await validators.validate("acme/tickets/1/input", TICKETS_SCHEMA, []), []);
    let ticks = 0;
    const ticker = setInterval(() => ticks++, 2);
    try {
      await assert.rejects(validators.validate("acme/tickets/1/input", TICKETS_SCHEMA, MANY_TICKETS), (error) => {
        assert.ok(error instanceof ValidationTimeout);
        assert.match(error.message, /took longer than 5 ms/);
        return true;
      });
    } finally {
      clearInterval(ticker);
    }
    // The caller's timers ran meanwhile: the validation never held this thread.
    assert.ok(ticks >= 1, `this thread's timers ran ${ticks} times meanwhile`);
    // The Worker that ran over was terminated; once it has finished (it cannot be stopped sooner), its successor
    // compiles the schema again and answers.
    assert.deepEqual(await validators.validate("acme/tickets/1/input", TICKETS_SCHEMA, [TICKETS[4]]), [
      { pointer: "/0", message: 'Instance does not have required property "body".' },
    ]);
  } finally {
    await validators.close();
  }
});

Deno.test("a validation estimated past the Worker's bound is refused without running, and does not time out", async () => {
  const validators = createSchemaValidators({ workers: 1 });
  try {
    // Shallow, a fan-out through $ref is small enough for this thread.
    const shallow = validators.validate("acme/tree/1/input", FAN_OUT, nested(3));
    assert.ok(await settlesInThisTurn(shallow));
    assert.deepEqual(await shallow, compileSchema(structuredClone(FAN_OUT)).validate(nested(3)));
    // 2^40 evaluations: in any thread it would never finish.
    await assert.rejects(validators.validate("acme/tree/1/input", FAN_OUT, nested(40)), ValidationTooCostly);
    // A long string against a large expression (size about 2,000 as RE2 compiles it): linear, but long.
    const large = { type: "string", pattern: "a.{0,1000}b" };
    await assert.rejects(validators.validate("acme/large/1/input", large, "a".repeat(20_000)), ValidationTooCostly);
    // The same Worker answers the next one at once.
    assert.deepEqual(await validators.validate("acme/large/1/input", large, "a".repeat(300) + "b"), []);
  } finally {
    await validators.close();
  }
});

Deno.test("concurrent validations each get their answer while slow ones time out", async () => {
  const validators = createSchemaValidators({ workers: 2, deadlineMs: 5 });
  try {
    const pattern = { type: "string", pattern: "^[a-z]+$" };
    const calls: { run: Promise<unknown>; expect: unknown }[] = [];
    for (let i = 0; i < 40; i++) {
      const instance = i % 3 === 0 ? "abc" : "ab1";
      const expect = instance === "abc" ? [] : [{ pointer: "", message: "String does not match pattern." }];
      calls.push({ run: validators.validate(`t${i % 4}/p/1/input`, pattern, instance), expect });
      calls.push({
        run: validators.validate("t/ticket/1/input", TICKET, TICKETS[i % TICKETS.length]),
        expect: compileSchema(structuredClone(TICKET)).validate(TICKETS[i % TICKETS.length]),
      });
      if (i % 20 === 5) {
        calls.push({
          run: validators.validate("t/tickets/1/input", TICKETS_SCHEMA, MANY_TICKETS),
          expect: ValidationTimeout,
        });
      }
    }
    const results = await Promise.allSettled(calls.map((c) => c.run));
    for (const [i, result] of results.entries()) {
      const { expect } = calls[i]!;
      if (expect === ValidationTimeout) {
        assert.equal(result.status, "rejected");
        assert.ok((result as PromiseRejectedResult).reason instanceof ValidationTimeout);
      } else {
        assert.equal(result.status, "fulfilled", String((result as PromiseRejectedResult).reason));
        assert.deepEqual((result as PromiseFulfilledResult<unknown>).value, expect);
      }
    }
  } finally {
    await validators.close();
  }
});

Deno.test("one tenant's burst of Worker validations does not hold another tenant's behind it", async () => {
  const validators = createSchemaValidators({ workers: 1, fastPathUnits: 0, maxPendingPerTenant: 12 });
  try {
    // Everything goes to a Worker; one Worker, so the order in which they finish is the order served.
    const pattern = { type: "string", pattern: "^[a-z]+$" };
    const finished: string[] = [];
    const run = (tenant: string, i: number) =>
      validators.validate(`${tenant}/p/1/input`, pattern, "abc").then(() => finished.push(`${tenant}${i}`));
    const burst = Array.from({ length: 12 }, (_, i) => run("burst", i));
    const quiet = run("quiet", 0);
    await Promise.all([...burst, quiet]);
    assert.equal(finished.length, 13);
    // Served in turn: the quiet tenant's one validation waits for at most one of the burst's, not all twelve.
    assert.ok(finished.indexOf("quiet0") <= 1, `finished in this order: ${finished.join(", ")}`);
    // Each tenant's own validations keep their order.
    assert.deepEqual(finished.filter((f) => f.startsWith("burst")), burst.map((_, i) => `burst${i}`));
  } finally {
    await validators.close();
  }
});

Deno.test("a key every tenant shares (a built-in task's) still waits in the turn of the tenant named", async () => {
  const validators = createSchemaValidators({ workers: 1, fastPathUnits: 0, maxPendingPerTenant: 12 });
  try {
    const pattern = { type: "string", pattern: "^[a-z]+$" };
    const finished: string[] = [];
    const run = (tenant: string, i: number) =>
      validators.validate("/shared/1/input", pattern, "abc", tenant).then(() => finished.push(`${tenant}${i}`));
    const burst = Array.from({ length: 12 }, (_, i) => run("burst", i));
    await Promise.all([...burst, run("quiet", 0)]);
    assert.ok(finished.indexOf("quiet0") <= 1, `finished in this order: ${finished.join(", ")}`);
  } finally {
    await validators.close();
  }
});

Deno.test("a schema is compiled once per key, in this thread and on the Worker, until evicted", async () => {
  const validators = createSchemaValidators({ cacheSize: 2, workers: 1 });
  try {
    const short = { type: "string", maxLength: 3 };
    const long = { type: "string", maxLength: 10 };
    const a = { type: "string", pattern: "^a+$" };
    const b = { type: "string", pattern: "^b+$" };
    const tooLong = [{ pointer: "", message: "String is too long (5 > 3)." }];
    const noMatch = [{ pointer: "", message: "String does not match pattern." }];
    // A key names one schema for good: a later schema under it is not compiled.
    assert.deepEqual(await validators.validate("k1", short, "aaaaa"), tooLong);
    assert.deepEqual(await validators.validate("k1", long, "aaaaa"), tooLong);
    assert.deepEqual(await validators.validate("k2", a, "bbb"), noMatch);
    assert.deepEqual(await validators.validate("k2", b, "bbb"), noMatch);
    // Two more keys evict both: each is compiled anew from the schema it comes with.
    await validators.validate("k3", a, "a");
    await validators.validate("k4", a, "a");
    assert.deepEqual(await validators.validate("k1", long, "aaaaa"), []);
    assert.deepEqual(await validators.validate("k2", b, "bbb"), []);
    // The caller's schema is copied: changing it later changes nothing.
    const mutable = { type: "string", maxLength: 3 };
    assert.deepEqual(await validators.validate("k5", mutable, "aaaaa"), tooLong);
    mutable.maxLength = 10;
    assert.deepEqual(await validators.validate("k5", mutable, "aaaaa"), tooLong);
  } finally {
    await validators.close();
  }
});

Deno.test("close() rejects validations waiting for a Worker, and later calls", async () => {
  const validators = createSchemaValidators({ workers: 1 });
  const slow = validators.validate("t/tickets/1/input", TICKETS_SCHEMA, MANY_TICKETS);
  const waiting = validators.validate("t/tickets/1/input", TICKETS_SCHEMA, MANY_TICKETS);
  // It settles once its children are reaped; the validations it rejected, at once.
  const closing = validators.close();
  await assert.rejects(slow, /closed/);
  await assert.rejects(waiting, /closed/);
  await closing;
  await assert.rejects(validators.validate("t/ticket/1/input", TICKET, {}), /closed/);
});

Deno.test("the api command's permission set lets its process validate in a child, and needs its run grant", async () => {
  const flags = permissionFlags("api", parseConfig({}), MIGRATIONS);
  const run = async (flags: string[], isolation = "process") => {
    const out = await new Deno.Command(Deno.execPath(), {
      args: ["run", ...flags, "tests/support/validation_probe.ts", JSON.stringify(CUBIC), '"12a"', isolation],
      cwd: ROOT,
      stdout: "piped",
      stderr: "piped",
    }).output();
    return new TextDecoder().decode(out.stdout).trim();
  };
  const mismatch = [{ pointer: "", message: "String does not match pattern." }];
  assert.deepEqual(JSON.parse(await run(flags)), mismatch);
  // Without the run grant the child cannot start: the validation fails instead of hanging.
  const withoutRun = await run(flags.filter((flag) => !flag.startsWith("--allow-run=")));
  assert.match(withoutRun, /^failed: .*Requires run access/);
  // A compiled binary's set validates on a Worker: it reads the Worker's modules, and runs nothing.
  const binary = permissionFlags("api", parseConfig({}), MIGRATIONS, { binary: true });
  assert.deepEqual(JSON.parse(await run(binary, "thread")), mismatch);
  const withoutRead = await run(binary.filter((flag) => !flag.startsWith("--allow-read=")), "thread");
  assert.match(withoutRead, /^failed: .*Requires read access to ".*validation_worker\.ts"/);
});
