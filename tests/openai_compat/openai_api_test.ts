/**
 * The OpenAI-compatible front door, driven by the real `openai` SDK over HTTP: the API handler on a loopback
 * port, a worker calling the fake model, real Redis and Postgres. Each request is a run of the built-in chat
 * task, so effects are counted at the fake model.
 */
import assert from "node:assert/strict";
import OpenAI from "openai";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createJobWaiter } from "../../src/runs/job_waiter.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { startFakeModel } from "../support/fake_model_server.ts";
import { apiHandler, summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis } from "../_support.ts";

const SLOW = "[slow]";

Deno.test("the OpenAI SDK against the door: idempotency, streaming, waiting, errors, responses", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const model = startFakeModel((_, prompt) => ({ kind: "ok", delayMs: prompt.includes(SLOW) ? 2_500 : 0 }));
  const waiter = await createJobWaiter({ sql: db.sql, log: silentLogger });
  const handler = apiHandler({ redis: r.redis, sql: db.sql, keys }, {
    authMode: "api-key",
    waiter,
    models: new Set(["fake-model"]),
  });
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen() {} }, (req) => handler(req));
  const baseURL = `http://127.0.0.1:${server.addr.port}/v1`;
  const acme = await createApiKey(db.sql, "acme");
  const other = await createApiKey(db.sql, "other");
  const llm = createOpenAiLlm({ apiKey: "sk-test", model: "fake-model", baseURL: model.url });
  const worker = summaryWorker({ redis: r.redis, sql: db.sql, llm, keys }, {
    job: { model: "fake-model", budgetMs: 20_000, perCallTimeoutMs: 10_000 },
  });
  const stop = new AbortController();
  const running = worker.run(stop.signal);
  const client = new OpenAI({ apiKey: acme, baseURL, maxRetries: 0 });
  const calls = (marker: string) => model.prompts.filter((p) => p.includes(marker)).length;
  const ask = (text: string) => ({ model: "fake-model", messages: [{ role: "user" as const, content: text }] });
  try {
    await t.step("two creates with one Idempotency-Key: the same completion, one model call, Replayed", async (s) => {
      const body = ask("The export button crashes the app since this morning. [twice]");
      const options = { headers: { "Idempotency-Key": "door-twice-0000000001" } };
      const first = await client.chat.completions.create(body, options).withResponse();
      const second = await client.chat.completions.create(body, options).withResponse();
      assert.match(first.data.id, /^chatcmpl-[0-9a-f]{32}$/);
      assert.equal(second.data.id, first.data.id);
      assert.equal(second.data.choices[0]!.message.content, first.data.choices[0]!.message.content);
      assert.ok(first.data.choices[0]!.message.content);
      assert.equal(first.data.model, "fake-model");
      assert.equal(first.data.usage?.total_tokens, 2);
      assert.equal(first.response.headers.get("idempotent-replayed"), null);
      assert.equal(second.response.headers.get("idempotent-replayed"), "true");
      const runId = first.response.headers.get("oncely-run-id")!;
      assert.equal(first.data.id, `chatcmpl-${runId.replaceAll("-", "")}`);
      assert.equal(calls("[twice]"), 1);

      await s.step("stream: true yields the same text, from the committed result", async () => {
        const stream = await client.chat.completions.create(
          { ...body, stream: true, stream_options: { include_usage: true } },
          options,
        );
        let text = "";
        let usage: OpenAI.CompletionUsage | null | undefined;
        for await (const chunk of stream) {
          assert.equal(chunk.id, first.data.id);
          text += chunk.choices[0]?.delta.content ?? "";
          if (chunk.usage) usage = chunk.usage;
        }
        assert.equal(text, first.data.choices[0]!.message.content);
        assert.equal(usage?.total_tokens, 2);
        assert.equal(calls("[twice]"), 1);
      });

      await s.step("a new streamed run without a key streams its own answer", async () => {
        const stream = await client.chat.completions.create({
          ...ask("Streams a fresh answer. [fresh]"),
          stream: true,
        });
        let text = "";
        for await (const chunk of stream) text += chunk.choices[0]?.delta.content ?? "";
        assert.ok(text.length > 0);
        assert.equal(calls("[fresh]"), 1);
      });

      await s.step("the key with another body is a 422 in OpenAI's shape", async () => {
        await assert.rejects(
          client.chat.completions.create(ask("Another body entirely. [twice]"), options),
          (e) => e instanceof OpenAI.UnprocessableEntityError && e.status === 422,
        );
        assert.equal(calls("[twice]"), 1);
      });
    });

    await t.step("a wrong key raises AuthenticationError", async () => {
      const wrong = new OpenAI({ apiKey: "sk-wrong-key", baseURL, maxRetries: 0 });
      await assert.rejects(
        wrong.chat.completions.create(ask("hello")),
        (e) => e instanceof OpenAI.AuthenticationError && e.status === 401,
      );
    });

    await t.step("an unknown model is a 404 model_not_found; n > 1 and tools are 422 naming the field", async () => {
      await assert.rejects(
        client.chat.completions.create({ ...ask("hi"), model: "gpt-nonexistent" }),
        (e) => e instanceof OpenAI.NotFoundError && e.code === "model_not_found" && e.param === "model",
      );
      await assert.rejects(
        client.chat.completions.create({ ...ask("hi"), n: 2 }),
        (e) => e instanceof OpenAI.UnprocessableEntityError && e.param === "n",
      );
      await assert.rejects(
        client.chat.completions.create({
          ...ask("hi"),
          tools: [{ type: "function", function: { name: "f", parameters: {} } }],
        }),
        (e) => e instanceof OpenAI.UnprocessableEntityError && e.param === "tools",
      );
    });

    await t.step("structured output with a JSON Schema answers JSON valid against it", async () => {
      const completion = await client.chat.completions.create({
        ...ask("Classify: the export crashes. [schema]"),
        response_format: {
          type: "json_schema",
          json_schema: {
            name: "triage",
            strict: true,
            schema: {
              type: "object",
              properties: { urgent: { type: "boolean" } },
              required: ["urgent"],
              additionalProperties: false,
            },
          },
        },
      });
      const value = JSON.parse(completion.choices[0]!.message.content!);
      assert.equal(typeof value.urgent, "boolean");
      const sent = model.bodies.at(-1) as { response_format: { type: string } };
      assert.equal(sent.response_format.type, "json_schema");
    });

    await t.step(
      "slower than Prefer: wait=1: 408 + x-should-retry true naming the run; the retry gets it",
      async () => {
        const statuses: { status: number; retry: string | null; run: string | null }[] = [];
        const recording = new OpenAI({
          apiKey: acme,
          baseURL,
          maxRetries: 3,
          fetch: async (input, init) => {
            const res = await fetch(input, init);
            statuses.push({
              status: res.status,
              retry: res.headers.get("x-should-retry"),
              run: res.headers.get("oncely-run-id"),
            });
            return res;
          },
        });
        const completion = await recording.chat.completions.create(ask(`A slow one. ${SLOW} [retry]`), {
          headers: { "Idempotency-Key": "door-slow-retry-0000001", Prefer: "wait=1" },
        });
        assert.equal(statuses[0]!.status, 408);
        assert.equal(statuses[0]!.retry, "true");
        assert.ok(statuses[0]!.run);
        assert.equal(statuses.at(-1)!.status, 200);
        assert.equal(completion.id, `chatcmpl-${statuses[0]!.run!.replaceAll("-", "")}`);
        assert.equal(calls("[retry]"), 1);
      },
    );

    await t.step("without a key, the 408 says x-should-retry: false", async () => {
      const res = await fetch(`${baseURL}/chat/completions`, {
        method: "POST",
        headers: { authorization: `Bearer ${acme}`, "content-type": "application/json", prefer: "wait=1" },
        body: JSON.stringify(ask(`Slow without a key. ${SLOW} [nokey]`)),
      });
      const body = await res.json();
      assert.equal(res.status, 408);
      assert.equal(res.headers.get("x-should-retry"), "false");
      assert.equal(res.headers.get("retry-after"), "1");
      assert.equal(body.error.code, "run_pending");
    });

    await t.step("responses: background is queued at once, retrieve reaches completed with output_text", async (s) => {
      const created = await client.responses.create({
        model: "fake-model",
        input: "Summarise: the export button crashes. [background]",
        instructions: "Answer briefly.",
        background: true,
      });
      assert.match(created.id, /^resp_[0-9a-f]{32}$/);
      assert.ok(["queued", "in_progress", "completed"].includes(created.status!));
      let now = created;
      const end = performance.now() + 10_000;
      while (now.status !== "completed" && performance.now() < end) {
        await new Promise((resolve) => setTimeout(resolve, 50));
        now = await client.responses.retrieve(created.id);
      }
      assert.equal(now.status, "completed");
      assert.ok(now.output_text.length > 0);
      assert.equal(now.usage?.total_tokens, 2);
      assert.equal((model.bodies.at(-1) as { messages: { role: string }[] }).messages[0]!.role, "system");

      await s.step("another tenant's response id is a 404", async () => {
        const theirs = new OpenAI({ apiKey: other, baseURL, maxRetries: 0 });
        await assert.rejects(theirs.responses.retrieve(created.id), (e) => e instanceof OpenAI.NotFoundError);
      });
    });

    await t.step("responses without background wait and answer the completed object", async () => {
      const done = await client.responses.create({ model: "fake-model", input: "Foreground. [fg]" });
      assert.equal(done.status, "completed");
      assert.ok(done.output_text.length > 0);
    });

    await t.step("cancel of a slow background response ends cancelled with at most one model call", async () => {
      const created = await client.responses.create({
        model: "fake-model",
        input: `A slow one to cancel. ${SLOW} [cancel]`,
        background: true,
      });
      const cancelled = await client.responses.cancel(created.id);
      assert.equal(cancelled.status, "cancelled");
      await new Promise((resolve) => setTimeout(resolve, 3_000));
      assert.equal((await client.responses.retrieve(created.id)).status, "cancelled");
      assert.ok(calls("[cancel]") <= 1);
    });
  } finally {
    stop.abort();
    await running;
    await server.shutdown();
    await waiter.close();
    await model.close();
    await r.close();
    await db.close();
  }
});
