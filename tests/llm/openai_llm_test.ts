/**
 * The OpenAI adapter over the real SDK and a local server speaking the wire
 * format: what a call sends (system message, model, output cap, temperature,
 * a strict json_schema response format, follow-up turns) and what it reads.
 */
import assert from "node:assert/strict";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { MAX_OUTPUT_TOKENS } from "../../src/llm/llm.ts";
import { startFakeModel } from "../support/fake_model_server.ts";

Deno.test("a call sends what its options say, and only that", async () => {
  const server = startFakeModel(() => ({ kind: "ok", content: '{"category":"bug","urgent":true}' }));
  try {
    const llm = createOpenAiLlm({ apiKey: "sk-test", model: "default-model", baseURL: server.url });
    const signal = new AbortController().signal;
    const plain = await llm.complete("Summarise this.", { signal });
    assert.deepEqual(server.bodies[0], {
      model: "default-model",
      messages: [{ role: "user", content: "Summarise this." }],
      max_completion_tokens: MAX_OUTPUT_TOKENS,
    });
    assert.equal(plain.text, '{"category":"bug","urgent":true}');
    const schema = { type: "object", properties: { category: { type: "string" } }, required: ["category"] };
    await llm.complete("Classify: it broke.", {
      signal,
      system: "You sort tickets.",
      model: "other-model",
      maxOutputTokens: 200,
      temperature: 0,
      jsonSchema: { name: "ticket", schema },
      followUp: [
        { role: "assistant", content: "not json" },
        { role: "user", content: "That answer is not JSON. Answer again." },
      ],
    });
    assert.deepEqual(server.bodies[1], {
      model: "other-model",
      messages: [
        { role: "system", content: "You sort tickets." },
        { role: "user", content: "Classify: it broke." },
        { role: "assistant", content: "not json" },
        { role: "user", content: "That answer is not JSON. Answer again." },
      ],
      max_completion_tokens: 200,
      temperature: 0,
      response_format: { type: "json_schema", json_schema: { name: "ticket", schema, strict: true } },
    });
  } finally {
    await server.close();
  }
});
