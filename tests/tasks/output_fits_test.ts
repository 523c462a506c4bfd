/** A task whose output schema's smallest answer cannot fit its max_output_tokens is refused at PUT (issue 37). */
import assert from "node:assert/strict";
import { checkDefinition, DefinitionRefused } from "../../src/tasks/definition_check.ts";

const input_schema = { type: "object", properties: { text: { type: "string" } }, required: ["text"] };
const output = (items: Record<string, unknown>) => ({
  type: "object",
  properties: { labels: { type: "array", items: { type: "string" }, ...items } },
  required: ["labels"],
  additionalProperties: false,
});

Deno.test("an output schema whose smallest answer passes max_output_tokens is a refusal on /output_schema", () => {
  const started = performance.now();
  assert.throws(
    () =>
      checkDefinition({
        prompt: "Label {{input.text}}",
        input_schema,
        output_schema: output({ minItems: 300_000 }),
        max_output_tokens: 1024,
      }),
    (error: Error) => {
      assert.ok(error instanceof DefinitionRefused);
      assert.equal(error.pointer, "/output_schema");
      assert.match(error.message, /does not fit max_output_tokens \(1024 tokens/);
      return true;
    },
  );
  assert.ok(performance.now() - started < 1_000, "refused within the bound, not after building 300,000 items");
  // The same schema with room for its answer is accepted.
  checkDefinition({
    prompt: "Label {{input.text}}",
    input_schema,
    output_schema: output({ minItems: 300 }),
    max_output_tokens: 1024,
  });
});
