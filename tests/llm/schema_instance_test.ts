/**
 * The instance of a tenant's output schema is built within bounds (issue 37): the embedded model's answer and the
 * PUT check of a task whose output cannot fit its `max_output_tokens` both stop at a bound instead of building
 * millions of nodes on the worker's thread.
 */
import assert from "node:assert/strict";
import { createExtractiveLlm } from "../../src/llm/extractive.ts";
import { instanceOf, InstanceTooLarge, smallestInstanceChars } from "../../src/llm/schema_instance.ts";

const bounds = { maxChars: 1024 * 4, maxNodes: 1024 * 4 };
const huge = { type: "array", items: { type: "string" }, minItems: 300_000 };
// Four properties that each refer to the root: 4^32 nodes unbounded.
const fanOut = {
  type: "object",
  properties: { a: { $ref: "#" }, b: { $ref: "#" }, c: { $ref: "#" }, d: { $ref: "#" } },
  required: ["a", "b", "c", "d"],
  additionalProperties: false,
};

Deno.test("an ordinary schema's instance is what it was", () => {
  const schema = {
    type: "object",
    properties: {
      label: { type: "string", enum: ["bug", "question"] },
      score: { type: "integer", minimum: 3 },
      tags: { type: "array", items: { type: "string", minLength: 2 }, minItems: 2 },
    },
  };
  assert.deepEqual(instanceOf(schema, "t", bounds), { label: "bug", score: 3, tags: ["tx", "tx"] });
  assert.equal(smallestInstanceChars(schema, bounds), JSON.stringify(instanceOf(schema, "", bounds)).length);
});

Deno.test("minItems of 300,000 or a schema that refers to itself four times stops at the bound, at once", () => {
  for (const schema of [huge, fanOut]) {
    const started = performance.now();
    assert.throws(() => instanceOf(schema, "x", bounds), InstanceTooLarge);
    assert.equal(smallestInstanceChars(schema, bounds), Infinity);
    // Bounded work: 4,096 nodes at most, where it used to take seconds (minItems) or never end (fan-out).
    assert.ok(performance.now() - started < 500, `${performance.now() - started} ms`);
  }
  assert.throws(() => instanceOf({ type: "string", minLength: 50_000_000 }, "x", bounds), InstanceTooLarge);
});

Deno.test("the embedded model refuses a run whose output schema cannot fit its output cap", async () => {
  const llm = createExtractiveLlm();
  const signal = new AbortController().signal;
  await assert.rejects(
    llm.complete("Revenue rose. Costs fell.", { signal, jsonSchema: { name: "out", schema: huge } }),
    InstanceTooLarge,
  );
  // The summary too long for a small cap: the smallest strings still fit.
  const small = { type: "object", properties: { s: { type: "string" } } };
  const answer = await llm.complete("Revenue rose by a great deal this quarter. Costs fell.", {
    signal,
    maxOutputTokens: 3,
    jsonSchema: { name: "out", schema: small },
  });
  assert.deepEqual(JSON.parse(answer.text), { s: "x" });
});

Deno.test("a string schema with a huge minLength and a tiny maxLength allocates nothing: it has no instance", () => {
  const schema = {
    type: "object",
    properties: { a: { type: "string", minLength: 140_000_000, maxLength: 1 } },
    required: ["a"],
    additionalProperties: false,
  };
  assert.throws(() => instanceOf(schema, "x", bounds), InstanceTooLarge);
  assert.equal(smallestInstanceChars(schema, bounds), Infinity);
  // minLength within maxLength: padded to it, by code points.
  assert.deepEqual(instanceOf({ type: "string", minLength: 3, maxLength: 4 }, "é", bounds), "éxx");
  assert.deepEqual(instanceOf({ type: "string", maxLength: 2 }, "😀😀😀", bounds), "😀😀");
});
