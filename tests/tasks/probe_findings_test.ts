/**
 * What the fourth and fifth probes of issue 37 found left for a tenant to hold
 * the API with, each a validation the estimate counted far below its real
 * cost, or a measure with no budget:
 * - a long `const` (or `enum`) counted as one unit, whose failing messages
 *   `contains` keeps for every item (one run POST took an API to its heap
 *   limit);
 * - the rendered prompt's length measured by stringifying the input once per
 *   placeholder (62 nested placeholders over 960 KB: 380 ms a request);
 * - a long key counted once, though every location under it holds it (a
 *   600,000-character key over 10,000 failing items: out of memory);
 * - `enum` of objects against a large object, each entry comparing every key
 *   (27 s estimated at 60,000 units);
 * - a long `patternProperties` pattern, written into a location per key (8.6 s
 *   under the bound);
 * - a chain of references deeper than the estimate's stack (a RangeError);
 * - many regular expressions in a small schema, compiled on the serving thread.
 */
import assert from "node:assert/strict";
import { renderedChars, renderTemplate } from "../../src/tasks/definition.ts";
import { compileSchema, SchemaRefused } from "../../src/tasks/json_schema.ts";
import { createSchemaValidators, VALIDATION_LIMITS, ValidationTooCostly } from "../../src/tasks/validator.ts";

const LONG = "X".repeat(60_000);

Deno.test("a long const or enum is counted by its length: contains over many items is refused before it runs", async () => {
  const validators = createSchemaValidators({ workers: 1 });
  try {
    const contains = { type: "array", contains: { const: LONG } };
    for (const items of [100_000, 20_000]) {
      // Estimated at 4-5 units an item before: it ran, and kept 60 KB of message per item.
      await assert.rejects(
        validators.validate(`acme/const/${items}/input`, contains, new Array(items).fill(0)),
        ValidationTooCostly,
      );
    }
    const anyOf = { type: "array", items: { anyOf: [{ enum: [LONG, "y"] }, { type: "integer" }] } };
    await assert.rejects(
      validators.validate("acme/enum/1/input", anyOf, new Array(100_000).fill("z")),
      ValidationTooCostly,
    );
    // The same shapes with a short value still run, and answer.
    const short = { type: "array", contains: { const: "X" } };
    assert.deepEqual(await validators.validate("acme/short/1/input", short, [...new Array(20_000).fill(0), "X"]), []);
    const noMatch = await validators.validate("acme/short/1/input", short, new Array(20_000).fill(0));
    assert.equal(noMatch[0]?.pointer, "");
  } finally {
    await validators.close();
  }
});

Deno.test("the rendered length is the rendering's, and costs one walk of the input however many placeholders", () => {
  const nested = (depth: number, leaf: unknown): unknown => depth === 0 ? leaf : { a: nested(depth - 1, leaf) };
  const chain = (depth: number) => Array.from({ length: depth }, (_, i) => `{{input${".a".repeat(i + 1)}}}`).join(" ");
  const inputs: Record<string, unknown>[] = [
    { a: 'quote " backslash \\ newline \n tab \t nul \u0000 é 😀 lone \ud800 end' },
    { a: [1, -0, 1e21, 2.5e-7, true, false, null, "", [], {}, [[]], { 'k"ey': "v" }] },
    { a: { b: { c: "deep" }, list: [{ x: 1 }, { y: [2, 3] }] }, other: "not named" },
    nested(10, [0, "s", { z: null }]) as Record<string, unknown>,
  ];
  for (const input of inputs) {
    const definition = { prompt: `P ${chain(10)} {{input.a}} {{input.missing}} {{input.other}}`, system: chain(3) };
    const rendered = renderTemplate(definition.prompt, input).length + renderTemplate(definition.system, input).length;
    assert.equal(renderedChars(definition, input), rendered, JSON.stringify(input).slice(0, 80));
  }

  // The probe's request: 62 nested placeholders in the prompt and in the system message, over 480,000 items.
  const input = nested(62, new Array(480_000).fill(0)) as Record<string, unknown>;
  const definition = { prompt: chain(62), system: chain(62) };
  // Characters stringified while measuring: the work, counted rather than timed.
  const stringify = JSON.stringify;
  let chars = 0;
  JSON.stringify = ((...args: Parameters<typeof stringify>) => {
    const out = stringify(...args);
    chars += out?.length ?? 0;
    return out;
  }) as typeof stringify;
  let measured: number;
  try {
    measured = renderedChars(definition, input);
  } finally {
    JSON.stringify = stringify;
  }
  const whole = stringify(input).length;
  assert.ok(measured > 100 * whole, "over the limit by far, as the probe's was");
  // Before: each of the 124 placeholders stringified its whole value, about 124 x 960 KB.
  assert.ok(chars <= 2 * whole, `${chars} characters stringified for an input of ${whole}`);
});

Deno.test("a long key is counted in every location under it", async () => {
  const validators = createSchemaValidators({ workers: 1 });
  try {
    const schema = { type: "object", additionalProperties: { unevaluatedItems: false } };
    for (const items of [10_000, 1_000]) {
      // Estimated at 29,382 units before (10,000 items): it ran, and took the API past its heap limit.
      const instance = { ["k".repeat(600_000)]: new Array(items).fill(0) };
      await assert.rejects(validators.validate(`acme/key/${items}/input`, schema, instance), ValidationTooCostly);
    }
    // A 30,000-character key over 500 items ran in the serving thread (1,475 units): now it goes to a Worker.
    const instance = { ["k".repeat(30_000)]: new Array(500).fill(0) };
    assert.equal(validators.validateNow("acme/key/500/input", schema, instance), undefined);
    // Ordinary keys cost what they did.
    assert.deepEqual(validators.validateNow("acme/key/ok/input", schema, { name: [] }), []);
  } finally {
    await validators.close();
  }
});

Deno.test("an enum of objects against a large object is counted per entry and key", async () => {
  const validators = createSchemaValidators({ workers: 1 });
  try {
    const schema = { type: "object", enum: new Array(5_000).fill({}) };
    const instance = Object.fromEntries(Array.from({ length: 50_000 }, (_, i) => [`k${i}`, 0]));
    // Estimated at 60,004 units before: it took 27 s on a Worker that terminate() does not stop.
    await assert.rejects(validators.validate("acme/enum/1/input", schema, instance), ValidationTooCostly);
    assert.deepEqual(await validators.validate("acme/enum/1/input", schema, {}), []);
  } finally {
    await validators.close();
  }
});

Deno.test("a long patternProperties pattern is counted per key it is written for", async () => {
  const validators = createSchemaValidators({ workers: 1 });
  try {
    const schema = { patternProperties: { [`[a-z0-9${"漢".repeat(990)}]`]: false } };
    const instance = Object.fromEntries(Array.from({ length: 90_000 }, (_, i) => [`k${i}`, 0]));
    // Estimated at 978,909 units before, just under the bound: 8.6 s.
    await assert.rejects(validators.validate("acme/pp/1/input", schema, instance), ValidationTooCostly);
  } finally {
    await validators.close();
  }
});

Deno.test("a chain of references deeper than the stack is too costly, not an error", async () => {
  const validators = createSchemaValidators({ workers: 1 });
  try {
    const $defs: Record<string, unknown> = {};
    for (let i = 0; i < 990; i++) $defs[`d${i}`] = { $ref: `#/$defs/d${i + 1}` };
    $defs.d990 = { type: "object", additionalProperties: { $ref: "#/$defs/d0" } };
    const schema = { $ref: "#/$defs/d0", $defs };
    let instance: unknown = {};
    for (let i = 0; i < 40; i++) instance = { a: instance };
    await assert.rejects(validators.validate("acme/refs/1/input", schema, instance), ValidationTooCostly);
  } finally {
    await validators.close();
  }
});

Deno.test("a schema of many or costly regular expressions is compiled on a Worker, however small", async () => {
  const validators = createSchemaValidators({ workers: 1 });
  try {
    const schemaOf = (n: number) => ({
      type: "object",
      properties: Object.fromEntries(
        Array.from({ length: n }, (_, i) => [`p${i}`, { type: "string", pattern: `^.{0,30}${i}$` }]),
      ),
    });
    const few = schemaOf(VALIDATION_LIMITS.threadPatterns);
    const many = schemaOf(VALIDATION_LIMITS.threadPatterns + 1);
    assert.ok(JSON.stringify(many).length < VALIDATION_LIMITS.threadSchemaBytes);
    assert.deepEqual(validators.validateNow("acme/few/1/input", few, { p0: "x0" }), [], "few: in this thread");
    assert.equal(validators.validateNow("acme/many/1/input", many, { p0: "x0" }), undefined, "many: on a Worker");
    assert.deepEqual(await validators.validate("acme/many/1/input", many, { p0: "x0" }), []);
    // One expression can be costly too: RE2 writes a Unicode class out once per count (40 ms to compile here).
    const one = (pattern: string) => ({ type: "object", properties: { code: { type: "string", pattern } } });
    const costly = one(`^${"[\\p{L}\\p{N}]{0,198}".repeat(10)}$`);
    assert.equal(validators.validateNow("acme/costly/1/input", costly, { code: "x" }), undefined, "on a Worker");
    assert.deepEqual(await validators.validate("acme/costly/1/input", costly, { code: "x" }), []);
    for (const pattern of ["^[a-z]{1,20}-\\d+$", "^[\\p{L} ]+$", "^\\d{4}-\\d{2}-\\d{2}$"]) {
      assert.deepEqual(
        validators.validateNow(`acme/${pattern}/1/input`, one(pattern), { code: "x" }) !== undefined,
        true,
        pattern,
      );
    }
  } finally {
    await validators.close();
  }
});

Deno.test("format: regex is refused past a pattern's length and counted per character V8 parses", async () => {
  const validators = createSchemaValidators({ workers: 1 });
  try {
    const schema = { type: "string", format: "regex" };
    // 996 KB of \p{L} in one class: 39.5 s and 2.4 GB in V8's parser, estimated at 12,971 units.
    const long = `[${"\\p{L}".repeat(166_000)}]`;
    const [violation] = await validators.validate("acme/re/1/input", schema, long);
    assert.match(violation!.message, /regex/);
    // At the longest a pattern may be, it is parsed, and costs what V8 takes.
    const costly = { type: "array", items: { type: "string", format: "regex" } };
    const many = Array.from({ length: 2_000 }, (_, i) => `[${"\\p{L}".repeat(199)}${i}]`);
    await assert.rejects(validators.validate("acme/re/2/input", costly, many), ValidationTooCostly);
    assert.deepEqual(await validators.validate("acme/re/3/input", schema, "^[a-z]+$"), []);
  } finally {
    await validators.close();
  }
});

Deno.test("a schema's patterns are checked for length before V8 parses them", () => {
  // Against the meta-schemas (format: regex on every pattern), a 64 KiB pattern of \p{L} took 2.7 s before its
  // length was checked. Now the length comes first: a long pattern V8 would refuse is refused for its length.
  for (const pattern of [`[${"\\p{L}".repeat(10_800)}]`, `(${"a".repeat(1_100)}`]) {
    assert.throws(
      () => compileSchema({ type: "object", properties: { a: { type: "string", pattern } } }),
      (error: unknown) => error instanceof SchemaRefused && /at most 1000 characters/.test(error.message),
    );
  }
  // A short one V8 refuses is still refused as such.
  assert.throws(
    () => compileSchema({ type: "object", properties: { a: { type: "string", pattern: "(a" } } }),
    /not a valid regular expression/,
  );
});

Deno.test("short formats refuse a long string without walking it", () => {
  // 60 date-time checks of a 1 MB string took 2 s: each split it first.
  assert.equal(
    compileSchema({ allOf: [{ format: "date-time" }, { format: "date-time" }] }).validate("t".repeat(1e6)).length,
    1,
  );
  // What the library would accept, but no real value is so long.
  assert.equal(compileSchema({ format: "date-time" }).validate(`2026-12-06T10:00:00.${"1".repeat(100)}Z`).length, 1);
  assert.deepEqual(compileSchema({ format: "date-time" }).validate("2026-12-06T10:00:00.123456789+01:00"), []);
  assert.deepEqual(compileSchema({ format: "uuid" }).validate("6f1c2a52-8f0e-4a6a-9a1e-0c9f1b2d3e4f"), []);
});

Deno.test("missing required names are counted per enclosing evaluation", async () => {
  const validators = createSchemaValidators({ workers: 1 });
  try {
    const names = Array.from({ length: 6_000 }, (_, i) => `n${i}`);
    const $defs: Record<string, unknown> = {};
    for (let i = 0; i < 400; i++) $defs[`d${i}`] = { $ref: `#/$defs/d${i + 1}` };
    $defs.d400 = { required: names };
    // Each of the 6,000 errors is copied through 400 frames (about 8 ns a copy): 10 items are 0.2 s, which the
    // estimate counted as 132,000 units.
    const schema = { contains: { $ref: "#/$defs/d0" }, $defs };
    await assert.rejects(validators.validate("acme/req/1/input", schema, new Array(10).fill({})), ValidationTooCostly);
  } finally {
    await validators.close();
  }
});

Deno.test("a validation deeper than the validator's stack is too costly, never an error, in this thread and on a Worker", async () => {
  const inThread = createSchemaValidators({ workers: 1, fastPathUnits: Infinity });
  const onWorker = createSchemaValidators({ workers: 1, fastPathUnits: 0 });
  try {
    // The estimate walks it; the validator's own recursion, several frames a reference, may not: whether 900
    // references fit the stack depends on how far V8 has optimised the validator (its frames shrink), and the
    // longest chain a definition may hold is about that long. So either outcome is right, never an error: too
    // costly when the stack ran out, else the verdict.
    const $defs: Record<string, unknown> = {};
    for (let i = 0; i < 900; i++) $defs[`d${i}`] = { $ref: `#/$defs/d${i + 1}` };
    $defs.d900 = { type: "string" };
    const schema = { $ref: "#/$defs/d0", $defs };
    for (const pool of [inThread, onWorker]) {
      const outcome = await pool.validate("acme/deep/1/input", schema, "x").then(
        (violations) => violations,
        (error) => error,
      );
      if (outcome instanceof Error) assert.ok(outcome instanceof ValidationTooCostly, String(outcome));
      else assert.deepEqual(outcome, [], "validated: a string is a string");
      const wrong = await pool.validate("acme/deep/1/input", schema, 7).then((v) => v, (error) => error);
      if (wrong instanceof Error) assert.ok(wrong instanceof ValidationTooCostly, String(wrong));
      else assert.equal(wrong.length, 1, "validated: a number is not a string");
    }
  } finally {
    await inThread.close();
    await onWorker.close();
  }
});

Deno.test("uri formats are counted at what V8 takes per character", async () => {
  const validators = createSchemaValidators({ workers: 1 });
  try {
    // 11 checks of 1 MB: estimated at 187,528 units (103 ms), measured 267 ms, past the 250 ms deadline.
    const schema = { items: { allOf: Array.from({ length: 11 }, () => ({ format: "uri-reference" })) } };
    const instance = [`a://a@${"f-".repeat(499_990)} `];
    await assert.rejects(validators.validate("acme/uri/1/input", schema, instance), ValidationTooCostly);
    assert.deepEqual(await validators.validate("acme/uri/1/input", schema, ["https://example.com/a?b=c"]), []);
  } finally {
    await validators.close();
  }
});
