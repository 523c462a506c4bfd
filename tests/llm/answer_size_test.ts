/**
 * An answer over MAX_ANSWER_CHARS is refused as a permanent model error
 * (AnswerTooLarge, never retried), and a response body is not read past
 * MAX_RESPONSE_BYTES. Through the real openai SDK and the fake model server.
 */
import assert from "node:assert/strict";
import {
  AnswerTooLarge,
  boundedFetch,
  createOpenAiLlm,
  MAX_ANSWER_CHARS,
  MAX_RESPONSE_BYTES,
} from "../../src/llm/openai_llm.ts";
import { isRetryable } from "../../src/retry/classify.ts";
import { startFakeModel } from "../support/fake_model_server.ts";

Deno.test("an answer of MAX_ANSWER_CHARS is kept; one character more is AnswerTooLarge, not retryable", async () => {
  const answers = ["y".repeat(MAX_ANSWER_CHARS), "n".repeat(MAX_ANSWER_CHARS + 1)];
  const server = startFakeModel((n) => ({ kind: "ok", content: answers[n - 1]! }));
  try {
    const llm = createOpenAiLlm({ apiKey: "sk-test", model: "m", baseURL: server.url });
    const signal = new AbortController().signal;
    const kept = await llm.complete("Say yes a lot.", { signal });
    assert.equal(kept.text.length, MAX_ANSWER_CHARS);
    const error = await llm.complete("Say no a lot.", { signal }).then(() => undefined, (e) => e);
    assert.ok(error instanceof AnswerTooLarge, String(error));
    assert.match(
      error.message,
      new RegExp(`${MAX_ANSWER_CHARS + 1} characters, over the limit of ${MAX_ANSWER_CHARS}`),
    );
    assert.equal(isRetryable(error), false);
  } finally {
    await server.close();
  }
});

Deno.test("a 20 MB answer is refused without reading its body past MAX_RESPONSE_BYTES", async () => {
  const server = startFakeModel(() => ({ kind: "ok", content: "z".repeat(20_000_000) }));
  let read = 0;
  // Counts the bytes the SDK pulls from the response body.
  const counting: typeof fetch = async (input, init) => {
    const response = await fetch(input, init);
    const counted = response.body!.pipeThrough(
      new TransformStream<Uint8Array, Uint8Array>({
        transform(chunk, controller) {
          read += chunk.byteLength;
          controller.enqueue(chunk);
        },
      }),
    );
    return new Response(counted, { status: response.status, headers: response.headers });
  };
  try {
    const llm = createOpenAiLlm({ apiKey: "sk-test", model: "m", baseURL: server.url, fetch: counting });
    const error = await llm.complete("Say z.", { signal: new AbortController().signal }).then(
      () => undefined,
      (e) => e,
    );
    assert.ok(error instanceof AnswerTooLarge, String(error));
    assert.equal(isRetryable(error), false);
    // Its content-length says it is too large: the body is given up before it is read.
    assert.ok(read < MAX_RESPONSE_BYTES, `read ${read} bytes`);
  } finally {
    await server.close();
  }
});

Deno.test("boundedFetch() ends a body without a content-length once it passes the limit", async () => {
  const chunk = new Uint8Array(1 << 20);
  let pulled = 0;
  const endless: typeof fetch = () =>
    Promise.resolve(
      new Response(
        new ReadableStream<Uint8Array>({
          pull(controller) {
            pulled++;
            controller.enqueue(chunk);
          },
        }),
        { headers: { "content-type": "application/json" } },
      ),
    );
  const response = await boundedFetch(endless, 5 << 20)("http://model.invalid/v1/chat/completions");
  const error = await response.text().then(() => undefined, (e) => e);
  assert.ok(error instanceof AnswerTooLarge, String(error));
  assert.match(error.message, /more than 5242880 bytes/);
  // Five megabytes and the chunk that passed them, and a few the pipe had already asked for: not the stream.
  assert.ok(pulled <= 10, `pulled ${pulled} chunks`);
  // A response within the limit is read as it was sent.
  const small = await boundedFetch(() => Promise.resolve(new Response('{"ok":true}')), 100)("http://x.invalid/");
  assert.deepEqual(await small.json(), { ok: true });
});
