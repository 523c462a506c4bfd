/**
 * No tenant's schema can stall a process: a pattern that the definition
 * checks accept but that takes seconds on a long string (`^\d+\d+\d+$`, a
 * polynomial backtrack) is cut off by the validation deadline, at intake and
 * in the worker, while other runs go on. In the worker a timeout is no verdict
 * on the answer (a starved Worker times out too): no repair call is made, and
 * a run whose answer keeps timing out ends after its deliveries.
 */
import assert from "node:assert/strict";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { serviceKeys } from "../../src/summaries/keys.ts";
import { createJobWaiter } from "../../src/summaries/job_waiter.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { createSchemaValidators } from "../../src/tasks/validator.ts";
import { startFakeModel } from "../support/fake_model_server.ts";
import { apiHandler, jsonClient, summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

const SLOW = "^\\d+\\d+\\d+$";
const LONG = `${"1".repeat(3_000)}x`;

Deno.test("a pathological pattern cannot stall intake or the worker", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  // The stalling task's model answers a long code, to its repair call too; every other prompt gets a valid
  // value from its schema.
  const model = startFakeModel((_, prompt) =>
    prompt.startsWith("Stall") || prompt.startsWith("That answer")
      ? { kind: "ok", content: JSON.stringify({ code: LONG }) }
      : { kind: "ok" }
  );
  const waiter = await createJobWaiter({ sql: db.sql, log: silentLogger });
  const validators = createSchemaValidators();
  const api = apiHandler({ redis: r.redis, sql: db.sql, keys }, {
    authMode: "api-key",
    waiter,
    validate: validators.validate,
  });
  const acme = await createApiKey(db.sql, "acme");
  const llm = createOpenAiLlm({ apiKey: "sk-test", model: "m", baseURL: model.url });
  // Short deliveries, redelivered soon after each gives up, two at most.
  const worker = summaryWorker({ redis: r.redis, sql: db.sql, llm, keys }, {
    claimIdleMs: 500,
    maxDeliveries: 2,
    job: { budgetMs: 1_500, perCallTimeoutMs: 1_000, maxAttempts: 2 },
  });
  const stop = new AbortController();
  const running = worker.run(stop.signal);
  const call = jsonClient(api, acme);
  const schemaOf = (properties: Record<string, unknown>) => ({
    type: "object",
    properties,
    required: Object.keys(properties),
    additionalProperties: false,
  });
  try {
    assert.equal(
      (await call("PUT", "/v1/tasks/stall-in", {
        prompt: "Look at {{input.code}}",
        input_schema: schemaOf({ code: { type: "string", pattern: SLOW } }),
      })).status,
      201,
      "the definition checks accept the pattern",
    );
    assert.equal(
      (await call("PUT", "/v1/tasks/stall-out", {
        prompt: "Stall on {{input.n}}",
        input_schema: schemaOf({ n: { type: "integer" } }),
        output_schema: schemaOf({ code: { type: "string", pattern: SLOW } }),
      })).status,
      201,
    );
    assert.equal(
      (await call("PUT", "/v1/tasks/quick", {
        prompt: "Quick {{input.n}}",
        input_schema: schemaOf({ n: { type: "integer" } }),
        output_schema: schemaOf({ ok: { type: "boolean" } }),
      })).status,
      201,
    );

    await t.step("intake: the input's validation is cut off with a 422, and other requests are served", async () => {
      const finished: string[] = [];
      const [slow, quick] = await Promise.all([
        call("POST", "/v1/tasks/stall-in/runs", { input: { code: LONG } }, { "idempotency-key": "stall-intake-0001" })
          .finally(() => finished.push("slow")),
        (async () => {
          await new Promise((r) => setTimeout(r, 50));
          return call("POST", "/v1/tasks/quick/runs", { input: { n: 1 } }, { "idempotency-key": "quick-intake-0001" })
            .finally(() => finished.push("quick"));
        })(),
      ]);
      assert.equal(slow.status, 422);
      assert.equal(slow.body.errors[0].pointer, "/input");
      assert.match(slow.body.errors[0].message, /took longer than/);
      assert.equal(quick.status, 202);
      // The request that came second was answered first: the slow validation never held this thread.
      assert.deepEqual(finished, ["quick", "slow"]);
    });

    await t.step("worker: a stalling answer fails after two deliveries, no repair; other runs are done", async () => {
      const slow = await call("POST", "/v1/tasks/stall-out/runs", { input: { n: 1 } }, {
        "idempotency-key": "stall-worker-0001",
      });
      assert.equal(slow.status, 202);
      const quick = await Promise.all(
        Array.from({ length: 5 }, (_, i) =>
          call("POST", "/v1/tasks/quick/runs", { input: { n: i + 10 } }, {
            "idempotency-key": `quick-worker-000${i}`,
            prefer: "wait=10",
          })),
      );
      for (const q of quick) assert.equal(q.body.status, "done");
      const failed = await waitFor("the stalling run to fail", async () => {
        const run = await call("GET", `/v1/runs/${slow.body.run_id}`, undefined);
        return run.body.status === "failed" ? run.body : undefined;
      }, 15_000);
      assert.equal(failed.error, "exceeded 2 deliveries");
      const calls = model.prompts.filter((p) => p.startsWith("Stall") || p.startsWith("That answer"));
      assert.deepEqual(calls.map((p) => p.split(" ")[0]), ["Stall", "Stall"], "one call per delivery, no repair");
    });
  } finally {
    stop.abort();
    await running;
    await worker.close();
    await validators.close();
    await waiter.close();
    await model.close();
    await r.close();
    await db.close();
  }
});
