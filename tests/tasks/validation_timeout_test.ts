/**
 * A validation of an answer that times out (a Worker starved of CPU) is no verdict on the answer: it is asked
 * again within the delivery's deadline, never answered with a paid repair call, and the run ends done once the
 * validator comes back. The timeouts are real: a validator pool with a 1 ms deadline, on an answer that takes a
 * few milliseconds (`uniqueItems` over 500 strings).
 */
import assert from "node:assert/strict";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createJobWaiter } from "../../src/runs/job_waiter.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { silentLogger } from "../../src/log/logger.ts";
import type { SchemaViolation } from "../../src/tasks/json_schema.ts";
import { createSchemaValidators } from "../../src/tasks/validator.ts";
import { startFakeModel } from "../support/fake_model_server.ts";
import { apiHandler, jsonClient, summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

const WORDS = Array.from({ length: 250 }, (_, i) => `word-${i}`);
const OUTPUT_SCHEMA = {
  type: "object",
  properties: { words: { type: "array", uniqueItems: true, items: { type: "string" } } },
  required: ["words"],
  additionalProperties: false,
};

Deno.test("a validation that times out is asked again, never taken for a bad answer", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const model = startFakeModel(() => ({ kind: "ok", content: JSON.stringify({ words: WORDS }) }));
  const waiter = await createJobWaiter({ sql: db.sql, log: silentLogger });
  const healthy = createSchemaValidators();
  const starved = createSchemaValidators({ deadlineMs: 1, compileMs: 1 });
  // The next `starve` validations go to the starved pool; what each of them came to is recorded.
  let starve = 0;
  const starvedOutcomes: string[] = [];
  const validate = async (key: string, schema: unknown, instance: unknown): Promise<SchemaViolation[]> => {
    if (starve <= 0) return await healthy.validate(key, schema, instance);
    starve--;
    try {
      const violations = await starved.validate(key, schema, instance);
      starvedOutcomes.push("answered");
      return violations;
    } catch (error) {
      starvedOutcomes.push((error as Error).name);
      throw error;
    }
  };
  const api = apiHandler({ redis: r.redis, sql: db.sql, keys }, { authMode: "api-key", waiter });
  const call = jsonClient(api, await createApiKey(db.sql, "acme"));
  const llm = createOpenAiLlm({ apiKey: "sk-test", model: "m", baseURL: model.url });
  const failures: string[] = [];
  // A short delivery budget, and a redelivery soon after one gives up.
  const worker = summaryWorker({
    redis: r.redis,
    sql: db.sql,
    llm,
    keys,
    validators: { validate, prepare: healthy.prepare },
  }, {
    claimIdleMs: 500,
    job: { budgetMs: 1_500, perCallTimeoutMs: 1_000, maxAttempts: 2 },
    events: { failed: (_, error) => failures.push((error as Error).name) },
  });
  const stop = new AbortController();
  const running = worker.run(stop.signal);
  const repairs = () => model.prompts.filter((p) => p.startsWith("That answer")).length;
  const runOf = async (runId: string) => (await call("GET", `/v1/runs/${runId}`)).body;
  try {
    assert.equal(
      (await call("PUT", "/v1/tasks/words", {
        prompt: "List words for {{input.n}}",
        input_schema: { type: "object", properties: { n: { type: "integer" } }, required: ["n"] },
        output_schema: OUTPUT_SCHEMA,
      })).status,
      201,
    );

    await t.step(
      "two timeouts, then an answer: no repair call, and the run is done on its first delivery",
      async () => {
        starve = 2;
        const started = await call("POST", "/v1/tasks/words/runs", { input: { n: 1 } }, {
          "idempotency-key": "validation-timeout-0001",
          prefer: "wait=10",
        });
        assert.equal(started.body.status, "done", JSON.stringify(started.body));
        assert.deepEqual(started.body.output, { words: WORDS });
        assert.deepEqual(starvedOutcomes, ["ValidationTimeout", "ValidationTimeout"], "both validations timed out");
        assert.equal(repairs(), 0, "no repair call");
        assert.equal(model.requests, 1, "one model call");
        assert.deepEqual(failures, [], "no delivery failed");
      },
    );

    await t.step(
      "timeouts until the deadline: the delivery gives up with no repair call, and a later one is done",
      async () => {
        starvedOutcomes.length = 0;
        const before = model.requests;
        starve = Number.POSITIVE_INFINITY;
        const started = await call("POST", "/v1/tasks/words/runs", { input: { n: 2 } }, {
          "idempotency-key": "validation-timeout-0002",
        });
        assert.equal(started.status, 202);
        // Its budget is 1.5 s; each timed-out validation also replaces the pool's Worker, which a loaded machine
        // (CI, 500 tests in) took longer than 5 s in all to do. The claim is the outcome, not its speed.
        await waitFor("the delivery to give up at its deadline", () => failures.includes("DeadlineExceeded"), 20_000)
          .catch((error) => {
            // What it was doing instead, should it ever not give up.
            const seen = { failures, tries: starvedOutcomes, starved: starved.pool(), healthy: healthy.pool() };
            throw new Error(`${(error as Error).message}: ${JSON.stringify(seen)}`);
          });
        assert.ok(starvedOutcomes.length >= 2, `asked ${starvedOutcomes.length} times`);
        assert.ok(starvedOutcomes.every((o) => o === "ValidationTimeout"));
        assert.equal(repairs(), 0, "no repair call");
        assert.equal(model.requests - before, 1);
        assert.notEqual((await runOf(started.body.run_id)).status, "failed");
        // The validator comes back; the message is delivered again.
        starve = 0;
        const done = await waitFor("the run to be done", async () => {
          const run = await runOf(started.body.run_id);
          return run.status === "done" ? run : undefined;
        }, 10_000);
        assert.deepEqual(done.output, { words: WORDS });
        assert.equal(repairs(), 0, "still no repair call");
        assert.equal(model.requests - before, 2, "one call per delivery");
      },
    );
  } finally {
    stop.abort();
    await running;
    await worker.close();
    await healthy.close();
    await starved.close();
    await waiter.close();
    await model.close();
    await r.close();
    await db.close();
  }
});
