/**
 * The OpenAI-compatible front door, driven by the real `openai` SDK over HTTP: the API handler on a loopback
 * port, a worker calling the fake model, real Redis and Postgres. Each request is a run of the built-in chat
 * task, so effects are counted at the fake model.
 */
import assert from "node:assert/strict";
import OpenAI from "openai";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { openAiRoutes } from "../../src/openai_compat/openai_api.ts";
import { createIntake } from "../../src/runs/intake.ts";
import { createAuthenticator } from "../../src/tenants/authenticator.ts";
import { SUMMARIES } from "../../src/summaries/api.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createJobWaiter } from "../../src/runs/job_waiter.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { setTenantBudget } from "../../src/tenants/tenant_budgets.ts";
import { createPrices } from "../../src/llm/prices.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { errorBody, startFakeModel } from "../support/fake_model_server.ts";
import { apiHandler, budgetsOn, summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

/** Markers in a prompt that script the fake model: 2.5 s late, a permanent 400, a call that spends a budget. */
const SLOW = "[slow]";
const REJECT = "[reject]";
const SPEND = "[spend]";
/** The provider's own words in its 400: never shown to the tenant. */
const PROVIDER_TEXT = "Invalid prompt: policy gw-7.internal.example rejected key sk-live-0000";
/** A day's token budget, and what the SPEND call reports using of it: the next call's worst case no longer fits. */
const BUDGET_TOKENS = 1_000;
const SPENT = { prompt_tokens: 990, completion_tokens: 1 };
/** The keep-alive of the door built for that step: a tenth of the SLOW model's 2.5 s. */
const KEEP_ALIVE_MS = 250;

/** One event of an SSE stream as it arrived: its text (without the blank line) and when, in ms after the headers. */
interface Arrived {
  text: string;
  atMs: number;
}

/** Reads `res`'s SSE body to its end, event by event, with each event's arrival time. */
async function sseEvents(res: Response): Promise<Arrived[]> {
  const start = performance.now();
  const events: Arrived[] = [];
  const decoder = new TextDecoder();
  let buffered = "";
  for await (const bytes of res.body!) {
    buffered += decoder.decode(bytes, { stream: true });
    let end: number;
    while ((end = buffered.indexOf("\n\n")) >= 0) {
      events.push({ text: buffered.slice(0, end), atMs: performance.now() - start });
      buffered = buffered.slice(end + 2);
    }
  }
  assert.equal(buffered, "", "the stream ends after a whole event");
  return events;
}

Deno.test("the OpenAI SDK against the door: idempotency, streaming, waiting, errors, responses", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const model = startFakeModel((_, prompt) => {
    if (prompt.includes(REJECT)) {
      return { kind: "status", status: 400, body: errorBody(PROVIDER_TEXT, "invalid_request_error", "invalid_prompt") };
    }
    if (prompt.includes(SPEND)) return { kind: "ok", usage: SPENT };
    return { kind: "ok", delayMs: prompt.includes(SLOW) ? 2_500 : 0 };
  });
  const waiter = await createJobWaiter({ sql: db.sql, log: silentLogger });
  // Each process has its own budgets, as the API and a worker do; only the tenant "broke" has one.
  const prices = createPrices({ LLM_PRICES: { "fake-model": { in: 0.4, out: 1.6 } } });
  const budgets = () => budgetsOn({ redis: r.redis, sql: db.sql, keys }, { prices, ttlMs: 200 });
  const handler = apiHandler({ redis: r.redis, sql: db.sql, keys }, {
    authMode: "api-key",
    waiter,
    models: new Set(["fake-model"]),
    budgets: budgets(),
  });
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen() {} }, (req) => handler(req));
  const baseURL = `http://127.0.0.1:${server.addr.port}/v1`;
  const acme = await createApiKey(db.sql, "acme");
  const other = await createApiKey(db.sql, "other");
  const broke = await createApiKey(db.sql, "broke");
  await setTenantBudget(db.sql, "broke", { "--tokens-per-day": BUDGET_TOKENS });
  const llm = createOpenAiLlm({ apiKey: "sk-test", model: "fake-model", baseURL: model.url });
  const worker = summaryWorker({ redis: r.redis, sql: db.sql, llm, keys, budgets: budgets() }, {
    job: { model: "fake-model", budgetMs: 20_000, perCallTimeoutMs: 10_000 },
  });
  const stop = new AbortController();
  const running = worker.run(stop.signal);
  const client = new OpenAI({ apiKey: acme, baseURL, maxRetries: 0 });
  const calls = (marker: string) => model.prompts.filter((p) => p.includes(marker)).length;
  const ask = (text: string) => ({ model: "fake-model", messages: [{ role: "user" as const, content: text }] });
  /** What an SDK call threw (it must throw). */
  const thrown = async (call: Promise<unknown>) => {
    try {
      await call;
    } catch (error) {
      return error;
    }
    throw new Error("the call answered; it should have thrown");
  };
  /** The run document, as `GET /v1/runs/{id}` answers the tenant. */
  const runDocument = async (runId: string) => {
    const res = await fetch(`${baseURL}/runs/${runId}`, { headers: { authorization: `Bearer ${acme}` } });
    assert.equal(res.status, 200);
    return await res.json() as { status: string; attempts?: number; output?: unknown; error?: string };
  };
  const runIdOfResponse = (id: string) => id.slice("resp_".length).replace(/^(.{8})(.{4})(.{4})(.{4})/, "$1-$2-$3-$4-");
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

    await t.step("a streamed run slower than the keep-alive: SSE comments until its chunks, then [DONE]", async () => {
      // The door alone, with a short keep-alive (the production default is KEEPALIVE_MS, 15 s).
      const door = openAiRoutes({
        redis: r.redis,
        sql: db.sql,
        log: silentLogger,
        keys,
        authenticate: createAuthenticator({ sql: db.sql }, { mode: "api-key", cacheTtlMs: 0 }),
        intake: createIntake({ redis: r.redis }, { keys, resultTtlS: 86_400, path: SUMMARIES }),
        maxBodyBytes: 1 << 20,
        waiter,
        models: new Set(["fake-model"]),
        keepAliveMs: KEEP_ALIVE_MS,
      }).handler({ log: silentLogger });
      const kept = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen() {} }, (req) => door(req));
      const keptURL = `http://127.0.0.1:${kept.addr.port}/v1`;
      try {
        const body = { ...ask(`Slow and streamed. ${SLOW} [kept-raw]`), stream: true };
        const key = "door-keep-alive-raw-001";
        const sdk = new OpenAI({ apiKey: acme, baseURL: keptURL, maxRetries: 0 });
        const [{ res, events }, bySdk] = await Promise.all([
          (async () => {
            const res = await fetch(`${keptURL}/chat/completions`, {
              method: "POST",
              headers: { authorization: `Bearer ${acme}`, "content-type": "application/json", "idempotency-key": key },
              body: JSON.stringify(body),
            });
            return { res, events: await sseEvents(res) };
          })(),
          // The real SDK on the same slow path: it skips the comments and reads the chunks.
          (async () => {
            const { data: stream, response } = await sdk.chat.completions
              .create({ ...ask(`Slow, through the SDK. ${SLOW} [kept-sdk]`), stream: true })
              .withResponse();
            let text = "";
            for await (const chunk of stream) text += chunk.choices[0]?.delta.content ?? "";
            return { text, runId: response.headers.get("oncely-run-id")! };
          })(),
        ]);
        assert.equal(res.status, 200);
        assert.equal(res.headers.get("content-type"), "text/event-stream");
        const runId = res.headers.get("oncely-run-id")!;
        const firstData = events.findIndex((e) => e.text.startsWith("data: "));
        assert.ok(firstData > 0, "data came after comments");
        const waiting = events.slice(0, firstData);
        assert.ok(waiting.every((e) => /^: \S/.test(e.text)), JSON.stringify(waiting));
        // 2.5 s of model time at one comment every 250 ms: about ten, and never a silence near the model's.
        assert.ok(waiting.length >= 4, `${waiting.length} comments before the first chunk`);
        const gaps = waiting.map((e, i) => e.atMs - (i === 0 ? 0 : waiting[i - 1]!.atMs));
        assert.ok(Math.max(...gaps) < 1_250, `longest silence ${Math.max(...gaps).toFixed(0)} ms`);
        assert.ok(events[firstData]!.atMs >= 2_000, "the first chunk waited for the model");
        // Then the chunks, nothing else, and [DONE] last.
        const data = events.slice(firstData).map((e) => e.text);
        assert.ok(data.every((text) => text.startsWith("data: ")), JSON.stringify(data));
        assert.equal(data.at(-1), "data: [DONE]");
        const chunks = data.slice(0, -1).map((text) => JSON.parse(text.slice("data: ".length)));
        const text = chunks.map((c) => c.choices[0]?.delta.content ?? "").join("");
        assert.equal(chunks.at(-1).choices[0].finish_reason, "stop");
        assert.ok(chunks.every((c) => c.id === `chatcmpl-${runId.replaceAll("-", "")}`));
        // The streamed text is the committed result: the key's replay answers it whole, with no second call.
        const replay = await sdk.chat.completions.create(ask(`Slow and streamed. ${SLOW} [kept-raw]`), {
          headers: { "Idempotency-Key": key },
        }).withResponse();
        assert.equal(replay.response.headers.get("idempotent-replayed"), "true");
        assert.ok(text.length > 0);
        assert.equal(text, replay.data.choices[0]!.message.content);
        assert.equal(calls("[kept-raw]"), 1);
        assert.equal(bySdk.text, (await runDocument(bySdk.runId)).output);
        assert.ok(bySdk.text.length > 0);
        assert.equal(calls("[kept-sdk]"), 1);
      } finally {
        await kept.shutdown();
      }
    });

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
      // The model takes 2.5 s, so the answer at once cannot be a finished run.
      const created = await client.responses.create({
        model: "fake-model",
        input: `Summarise: the export button crashes. ${SLOW} [background]`,
        instructions: "Answer briefly.",
        background: true,
      });
      assert.match(created.id, /^resp_[0-9a-f]{32}$/);
      assert.ok(["queued", "in_progress"].includes(created.status!), `status at once: ${created.status}`);
      assert.equal(created.background, true);
      let now = created;
      const seen = new Set<string>([created.status!]);
      const end = performance.now() + 10_000;
      while (now.status !== "completed" && performance.now() < end) {
        await new Promise((resolve) => setTimeout(resolve, 50));
        now = await client.responses.retrieve(created.id);
        seen.add(now.status!);
      }
      assert.equal(now.status, "completed");
      assert.deepEqual([...seen].filter((status) => !["queued", "in_progress", "completed"].includes(status)), []);
      assert.equal(calls("[background]"), 1);
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
      // A finished response is answered as it is.
      const again = await client.responses.cancel(done.id);
      assert.equal(again.status, "completed");
      // (The SDK adds `output_text` on create and retrieve only.)
      assert.deepEqual(again.output, done.output);
    });

    await t.step("responses: retrieve echoes the create's background, instructions and metadata", async (s) => {
      const marker = "[echo]";
      const sent = {
        model: "fake-model",
        input: `Summarise: the export button crashes. ${marker}`,
        instructions: "Answer in one line.",
        metadata: { ticket: "T-1042", team: "support" },
        background: true,
      };
      const options = { headers: { "Idempotency-Key": "door-echo-key-0000001" } };
      const created = await client.responses.create(sent, options);
      assert.equal(created.background, true);
      assert.equal(created.instructions, sent.instructions);
      assert.deepEqual(created.metadata, sent.metadata);
      let now = await client.responses.retrieve(created.id);
      const end = performance.now() + 10_000;
      while (now.status !== "completed" && performance.now() < end) {
        await new Promise((resolve) => setTimeout(resolve, 50));
        now = await client.responses.retrieve(created.id);
      }
      assert.equal(now.status, "completed");
      assert.equal(now.background, true);
      assert.equal(now.instructions, sent.instructions);
      assert.deepEqual(now.metadata, sent.metadata);
      assert.deepEqual((await client.responses.cancel(created.id)).metadata, sent.metadata, "cancel of a done one");
      // The model got the instructions as the first message, once, and nothing of background or metadata.
      assert.equal(calls(marker), 1);
      const call = model.bodies[model.prompts.findIndex((p) => p.includes(marker))] as Record<string, unknown>;
      const messages = call.messages as { role: string; content: string }[];
      assert.deepEqual(messages.map((m) => m.role), ["system", "user"]);
      assert.equal(messages[0]!.content, sent.instructions);
      assert.ok(!JSON.stringify(call).includes("T-1042"), "metadata is not sent to the model");
      assert.ok(!("metadata" in call) && !("background" in call));

      await s.step(
        "the key's fingerprint is the body as sent, as before: a replay, and a 422 for other metadata",
        async () => {
          const again = await client.responses.create(sent, options).withResponse();
          assert.equal(again.data.id, created.id);
          assert.equal(again.response.headers.get("idempotent-replayed"), "true");
          assert.deepEqual(again.data.metadata, sent.metadata);
          await assert.rejects(
            client.responses.create({ ...sent, metadata: { ticket: "T-9999" } }, options),
            (e) => e instanceof OpenAI.UnprocessableEntityError,
          );
          assert.equal(calls(marker), 1);
        },
      );

      await s.step("a create without them retrieves OpenAI's defaults", async () => {
        const done = await client.responses.create({ model: "fake-model", input: "No extras. [echo-none]" });
        const got = await client.responses.retrieve(done.id);
        assert.equal(got.status, "completed");
        assert.equal(got.background, false);
        assert.equal(got.instructions, null);
        assert.deepEqual(got.metadata, {});
      });
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

    await t.step("cancel during the model call: cancelled at once, the call's result dropped, one call", async () => {
      const marker = "[cancel-running]";
      const created = await client.responses.create({
        model: "fake-model",
        input: `Cancelled while the model writes. ${SLOW} ${marker}`,
        background: true,
      });
      // The fake model has the call (it answers 2.5 s later): the run is in its model call.
      await waitFor("the model call", () => calls(marker) === 1);
      const at = model.prompts.findIndex((p) => p.includes(marker));
      assert.equal(model.usages[at], undefined, "the call is still under way");
      const cancelled = await client.responses.cancel(created.id);
      assert.equal(cancelled.id, created.id);
      assert.equal(cancelled.status, "cancelled");
      assert.deepEqual(cancelled.output, []);
      // The call under way finishes; the worker records it, drops its result and makes no other.
      await waitFor("the call's answer", () => model.usages[at] !== undefined, 5_000);
      const runId = runIdOfResponse(created.id);
      await waitFor("the call's attempt", async () => ((await runDocument(runId)).attempts ?? 0) >= 1, 5_000);
      await new Promise((resolve) => setTimeout(resolve, 500));
      const after = await client.responses.retrieve(created.id);
      assert.equal(after.status, "cancelled");
      assert.deepEqual(after.output, []);
      assert.equal(after.output_text, "");
      const document = await runDocument(runId);
      assert.equal(document.status, "cancelled");
      assert.equal(document.output, undefined);
      assert.equal(calls(marker), 1);
    });

    await t.step(
      "a run the model refuses for good: BadRequestError run_failed naming the run, text withheld",
      async () => {
        for (
          const [path, call] of [
            ["chat", () => client.chat.completions.create(ask(`Refused for good. ${REJECT} [chat]`))],
            [
              "responses",
              () => client.responses.create({ model: "fake-model", input: `Refused for good. ${REJECT} [resp]` }),
            ],
          ] as const
        ) {
          const error = await thrown(call());
          assert.ok(error instanceof OpenAI.BadRequestError, `${path}: ${error}`);
          assert.equal(error.status, 400);
          assert.equal(error.code, "run_failed");
          assert.equal(error.type, "invalid_request_error");
          // The worker's class of the failure, never the provider's own words.
          assert.equal((error.error as { message?: string }).message, "model_rejected: 400");
          assert.ok(!JSON.stringify(error.error).includes("sk-live"), path);
          assert.ok(!error.message.includes("gw-7"), path);
          assert.equal(error.headers.get("x-should-retry"), "false");
          const runId = error.headers.get("oncely-run-id");
          assert.match(runId ?? "", /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/, path);
          assert.equal((await runDocument(runId!)).status, "failed");
        }
        // A permanent 400 is not retried: one call each.
        assert.equal(calls(REJECT), 2);
      },
    );

    await t.step("a tenant whose budget is spent: RateLimitError budget_exhausted, no retry, no call", async () => {
      const spender = new OpenAI({ apiKey: broke, baseURL, maxRetries: 0 });
      // Fits the budget; the model then reports 991 of its 1,000 tokens.
      await spender.chat.completions.create({ ...ask(`Spends the day. ${SPEND}`), max_completion_tokens: 16 });
      assert.equal(calls(SPEND), 1);
      const views = budgets();
      await waitFor("the spend settled", async () => ((await views.views("broke"))[0]?.spent ?? 0) >= 991);
      // The SDK may retry twice; x-should-retry: false must stop it at one request.
      const sent: number[] = [];
      const sdk = new OpenAI({
        apiKey: broke,
        baseURL,
        maxRetries: 2,
        fetch: async (input, init) => {
          const res = await fetch(input, init);
          sent.push(res.status);
          return res;
        },
      });
      const error = await thrown(
        sdk.chat.completions.create({ ...ask("One more. [over]"), max_completion_tokens: 16 }, {
          headers: { "Idempotency-Key": "door-over-budget-000001" },
        }),
      );
      assert.ok(error instanceof OpenAI.RateLimitError, String(error));
      assert.equal(error.status, 429);
      assert.equal(error.code, "budget_exhausted");
      assert.equal(error.type, "rate_limit_error");
      assert.equal(error.headers.get("x-should-retry"), "false");
      assert.deepEqual(sent, [429]);
      assert.equal(calls("[over]"), 0);
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
