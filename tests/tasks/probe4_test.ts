/**
 * The fourth probe of issue 37 found two ways left for a tenant to hold the
 * API: a long `const` (or `enum`) counted as one unit of validation work, whose
 * failing messages `contains` keeps for every item (one run POST took an API
 * to its heap limit), and the rendered prompt's length measured by
 * stringifying the input once per placeholder (62 nested placeholders over a
 * 960 KB input held the serving thread 380 ms a request).
 */
import assert from "node:assert/strict";
import { renderedChars, renderTemplate } from "../../src/tasks/definition.ts";
import { createSchemaValidators, ValidationTooCostly } from "../../src/tasks/validator.ts";

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
