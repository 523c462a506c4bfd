/**
 * The adapter checks the usage a provider reports before anything trusts it
 * (integers from 0 to MAX_REPORTED_TOKENS), and treats anything else as
 * unknown usage, logged once with the value as sent. Through the real
 * openai SDK and the fake model server.
 */
import assert from "node:assert/strict";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { checkUsage, MAX_REPORTED_TOKENS } from "../../src/llm/provider_usage.ts";
import { createLogger } from "../../src/log/logger.ts";
import { startFakeModel } from "../support/fake_model_server.ts";
import { recordingLogger } from "../_support.ts";

Deno.test("checkUsage() takes three integer counts in range, and refuses anything else naming the field", () => {
  const ok = { prompt_tokens: 10, completion_tokens: 5, total_tokens: 15 };
  assert.deepEqual(checkUsage(ok), { usage: ok });
  assert.deepEqual(checkUsage(undefined), {});
  assert.deepEqual(checkUsage(null), {});
  // A server that leaves total_tokens out: the sum.
  assert.deepEqual(checkUsage({ prompt_tokens: 10, completion_tokens: 5 }), { usage: ok });
  const top = { prompt_tokens: MAX_REPORTED_TOKENS, completion_tokens: 0, total_tokens: MAX_REPORTED_TOKENS };
  assert.deepEqual(checkUsage(top), { usage: top });
  const cases: [unknown, string, string][] = [
    [{ ...ok, prompt_tokens: -1 }, "prompt_tokens", "-1"],
    [{ ...ok, prompt_tokens: "10" }, "prompt_tokens", '"10"'],
    [{ ...ok, prompt_tokens: 1e15 }, "prompt_tokens", "1000000000000000"],
    [{ ...ok, completion_tokens: 0.5 }, "completion_tokens", "0.5"],
    [{ ...ok, completion_tokens: null }, "completion_tokens", "null"],
    [{ ...ok, total_tokens: MAX_REPORTED_TOKENS + 1 }, "total_tokens", String(MAX_REPORTED_TOKENS + 1)],
    [{ total_tokens: 3 }, "prompt_tokens", "undefined"],
    ["lots", "usage", '"lots"'],
    [[1, 2, 3], "usage", "[1,2,3]"],
    // A value a provider could make a megabyte long is logged cut short.
    [{ ...ok, prompt_tokens: "9".repeat(1_000) }, "prompt_tokens", `"${"9".repeat(99)}...`],
  ];
  for (const [raw, field, value] of cases) {
    assert.deepEqual(checkUsage(raw), { refused: { field, value } }, JSON.stringify(raw)?.slice(0, 80));
  }
});

Deno.test("a completion whose usage is out of range or not an integer has unknown usage, logged once", async () => {
  const bad: Record<string, unknown>[] = [
    { prompt_tokens: -50, completion_tokens: 10, total_tokens: -40 },
    { prompt_tokens: "12", completion_tokens: "5", total_tokens: "17" },
    { prompt_tokens: 1e15, completion_tokens: 10, total_tokens: 1e15 + 10 },
    { prompt_tokens: 0.5, completion_tokens: 10, total_tokens: 10.5 },
  ];
  const server = startFakeModel((n) =>
    n <= bad.length
      ? { kind: "ok", content: "An answer.", rawUsage: bad[n - 1]! }
      : { kind: "ok", content: "An answer.", usage: { prompt_tokens: 3, completion_tokens: 4 } }
  );
  const logged = recordingLogger();
  try {
    const llm = createOpenAiLlm({
      apiKey: "sk-test",
      model: "m",
      baseURL: server.url,
      log: createLogger({ write: logged.write }),
    });
    const signal = new AbortController().signal;
    for (const [i, usage] of bad.entries()) {
      const completion = await llm.complete(`Call ${i}`, { signal });
      // The answer is kept: the provider answered, only its accounting is unknown.
      assert.equal(completion.text, "An answer.");
      assert.equal(completion.usage, undefined, JSON.stringify(usage));
      assert.equal(completion.requestId, `req_${i + 1}`);
    }
    const lines = logged.lines.filter((l) => l.event === "provider_usage_invalid");
    assert.deepEqual(
      lines.map((l) => [l.level, l.field, l.value, l.request_id]),
      [
        ["warn", "prompt_tokens", "-50", "req_1"],
        ["warn", "prompt_tokens", '"12"', "req_2"],
        ["warn", "prompt_tokens", "1000000000000000", "req_3"],
        ["warn", "prompt_tokens", "0.5", "req_4"],
      ],
    );
    // A good usage passes as it was sent, and logs nothing.
    const good = await llm.complete("Call 5", { signal });
    assert.deepEqual(good.usage, { prompt_tokens: 3, completion_tokens: 4, total_tokens: 7 });
    assert.equal(logged.lines.filter((l) => l.event === "provider_usage_invalid").length, 4);
  } finally {
    await server.close();
  }
});
