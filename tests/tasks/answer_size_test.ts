/**
 * A model answer over MAX_ANSWER_CHARS fails its run at once as a permanent
 * model error: one model call, a clear error in the run document, and
 * nothing of the answer stored (no result row) or sent (no completion
 * notification; a run's failure notice carries only the error class). The
 * real API handler, a worker and the fake model through the real openai SDK.
 */
import assert from "node:assert/strict";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { createJobWaiter } from "../../src/runs/job_waiter.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { startFakeModel } from "../support/fake_model_server.ts";
import { apiHandler, jsonClient, summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis } from "../_support.ts";

/** What a misbehaving provider answers a prompt carrying the marker: 20 MB of text. */
const HUGE = "[[huge-answer]]";

Deno.test("an answer over MAX_ANSWER_CHARS fails the run as a model error: nothing stored or sent", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const model = startFakeModel((_, prompt) =>
    prompt.includes(HUGE) ? { kind: "ok", content: "z".repeat(20_000_000) } : { kind: "ok", content: "A short answer." }
  );
  const waiter = await createJobWaiter({ sql: db.sql, log: silentLogger });
  const api = apiHandler({ redis: r.redis, sql: db.sql, keys }, { authMode: "api-key", waiter });
  const call = jsonClient(api, await createApiKey(db.sql, "acme"));
  const llm = createOpenAiLlm({ apiKey: "sk-test", model: "default-model", baseURL: model.url });
  const worker = summaryWorker({ redis: r.redis, sql: db.sql, llm, keys });
  const stop = new AbortController();
  const running = worker.run(stop.signal);
  try {
    const put = await call("PUT", "/v1/tasks/echo", {
      prompt: "Echo: {{input.text}}",
      input_schema: { type: "object", properties: { text: { type: "string" } }, required: ["text"] },
    });
    assert.equal(put.status, 201);
    const post = (path: string, key: string, body: unknown) =>
      call("POST", path, body, { "idempotency-key": key, prefer: "wait=10" });

    const huge = await post("/v1/tasks/echo/runs", "answer-size-run-huge", {
      input: { text: HUGE },
      notify: "ops@example.com",
    });
    assert.equal(huge.status, 200, JSON.stringify(huge.body));
    assert.equal(huge.body.status, "failed");
    assert.equal(huge.body.error, "answer_too_large");
    assert.equal(huge.body.output, undefined);
    const hugeSummary = await post("/v1/summaries", "answer-size-summary-huge", {
      text: `Numbers. ${HUGE}`,
      notify: "a@b.co",
    });
    assert.equal(hugeSummary.status, 200, JSON.stringify(hugeSummary.body));
    assert.equal(hugeSummary.body.status, "failed");
    assert.equal(hugeSummary.body.error, "answer_too_large");
    // The same tenant's ordinary runs are untouched.
    const fine = await post("/v1/tasks/echo/runs", "answer-size-run-fine", {
      input: { text: "hello" },
      notify: "ops@example.com",
    });
    assert.deepEqual([fine.body.status, fine.body.output], ["done", "A short answer."]);

    // Permanent: one call each, not retried.
    assert.equal(model.prompts.filter((p) => p.includes(HUGE)).length, 2);
    const ids = [huge.body.run_id, hugeSummary.body.job_id];
    const [outcomes] = await db.sql<[{ failed: number; reasons: string[] }]>`
      SELECT count(*)::int AS failed, array_agg(error) AS reasons FROM job_outcomes
      WHERE job_id = ANY(${ids}::uuid[]) AND outcome = 'failed'`;
    assert.equal(outcomes.failed, 2);
    for (const reason of outcomes.reasons) {
      // A 20 MB body is refused by its size before it is read (MAX_RESPONSE_BYTES, six bytes a character).
      assert.match(reason, /^permanent: AnswerTooLarge: the model provider's response is \d+ bytes, over the limit/);
    }
    // Nothing of the answer stored...
    const [stored] = await db.sql<[{ n: number }]>`
      SELECT (SELECT count(*) FROM run_results WHERE run_id = ANY(${ids}::uuid[]))
        + (SELECT count(*) FROM summaries WHERE job_id = ANY(${ids}::uuid[]))::int AS n`;
    assert.equal(Number(stored.n), 0);
    // ...or sent: the run's only notification is its failure notice, which names the error class alone.
    const outbox = await db.sql<{ dedupe_key: string; size: number; error: string }[]>`
      SELECT dedupe_key, length(payload::text) AS size, payload->>'error' AS error FROM outbox
      WHERE dedupe_key LIKE ${`%${huge.body.run_id}`} OR dedupe_key LIKE ${`%${hugeSummary.body.job_id}`}`;
    assert.equal(outbox.length, 1, JSON.stringify(outbox));
    assert.match(outbox[0]!.dedupe_key, /^run_failed:/);
    assert.equal(outbox[0]!.error, "answer_too_large");
    assert.ok(outbox[0]!.size < 2_000, `payload of ${outbox[0]!.size} characters`);
  } finally {
    stop.abort();
    await running;
    await worker.close();
    await waiter.close();
    await model.close();
    await r.close();
    await db.close();
  }
});
