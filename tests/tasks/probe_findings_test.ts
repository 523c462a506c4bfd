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

Deno.test("a schema of many regular expressions is compiled on a Worker, however small", async () => {
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
  } finally {
    await validators.close();
  }
});
