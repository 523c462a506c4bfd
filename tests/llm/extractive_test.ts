import assert from "node:assert/strict";
import { compileSchema } from "../../src/tasks/json_schema.ts";
import { createExtractiveLlm, splitSentences, summariseExtractively } from "../../src/llm/extractive.ts";
import { summaryPrompt } from "../../src/llm/llm.ts";

const DOC = [
  "Parking spaces were reassigned in the spring.",
  "The Q3 report shows revenue growth across every region.",
  "Revenue in Europe grew 14 percent, and revenue in Asia grew 9 percent.",
  "The office kitchen was repainted in August.",
  "Growth in revenue came mostly from new enterprise contracts.",
  "Several employees attended a conference.",
  "The weather was pleasant for most of the quarter.",
  "Enterprise contracts now drive most revenue growth, the report concludes.",
  "A new coffee machine arrived.",
  "Someone lost an umbrella.",
].join(" ");

Deno.test("splitSentences() splits on sentence ends and keeps order", () => {
  assert.deepEqual(splitSentences("One. Two!  Three?\nFour"), ["One.", "Two!", "Three?", "Four"]);
});

Deno.test("summariseExtractively() keeps the most salient sentences, in document order", () => {
  const summary = summariseExtractively(DOC);
  const picked = splitSentences(summary);
  assert.equal(picked.length, 2);
  for (const s of picked) assert.match(s, /revenue/i, `salient: ${s}`);
  assert.doesNotMatch(summary, /kitchen|umbrella|coffee|parking/i);
  const order = picked.map((s) => DOC.indexOf(s));
  assert.deepEqual(order, [...order].sort((a, b) => a - b));
  assert.ok(!DOC.startsWith(summary), "not a truncation of the input");
});

Deno.test("summariseExtractively() is deterministic", () => {
  const runs = new Set(Array.from({ length: 5 }, () => summariseExtractively(DOC)));
  assert.equal(runs.size, 1);
});

Deno.test("the extractive LLM summarises the document in the prompt, not the instruction", async () => {
  const llm = createExtractiveLlm();
  const out = await llm.complete(summaryPrompt(DOC), { signal: new AbortController().signal });
  assert.equal(out.text, summariseExtractively(DOC));
  const short = await llm.complete(summaryPrompt("Just one sentence."), { signal: new AbortController().signal });
  assert.equal(short.text, "Just one sentence.");
});

Deno.test("asked for structured output, the extractive LLM answers a value valid against the schema", async () => {
  const schema = {
    type: "object",
    properties: {
      summary: { type: "string" },
      category: { enum: ["bug", "billing"] },
      tags: { type: "array", items: { type: "string", maxLength: 5 } },
      score: { type: "integer", minimum: 3 },
    },
    required: ["summary", "category", "tags", "score"],
    additionalProperties: false,
  };
  const out = await createExtractiveLlm().complete("Just one sentence.", {
    signal: new AbortController().signal,
    jsonSchema: { name: "t", schema },
  });
  const value = JSON.parse(out.text);
  assert.deepEqual(compileSchema(schema).validate(value), []);
  assert.equal(value.summary, "Just one sentence.");
});
