/**
 * No tenant's pattern can stall a process. A PUT whose pattern has two
 * unbounded repetitions that can match the same character one after the
 * other (`^\d*\d*x`), or that RE2 cannot express (a look-ahead), is a 422
 * naming the pattern. One that passes can still be one V8 would backtrack on
 * for ever (`SEPARATED`: ten `\d+` with a `.` between each two, which also
 * matches a digit; V8 took 4.3 s on 50 digits), and it runs on RE2: at intake
 * a flood of inputs of 200 digits is answered at once, with a 422 naming the
 * value, while another tenant is served; in the worker an answer of 200 digits
 * is judged at once, so it gets its repair call and the run fails on the
 * second answer, while other runs are done.
 */
import assert from "node:assert/strict";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createJobWaiter } from "../../src/runs/job_waiter.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { createSchemaValidators } from "../../src/tasks/validator.ts";
import { startFakeModel } from "../support/fake_model_server.ts";
import { apiHandler, jsonClient, summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

const SEPARATED = `^${Array(10).fill("\\d+").join(".")}x$`;
const DIGITS = "1".repeat(200);

Deno.test("a pattern V8 would backtrack on for ever stalls neither intake nor the worker", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  // The stalling task's model answers 200 digits, to its repair call too; every other prompt gets a valid
  // value from its schema.
  const model = startFakeModel((_, prompt) =>
    prompt.startsWith("Stall") || prompt.startsWith("That answer")
      ? { kind: "ok", content: JSON.stringify({ code: DIGITS }) }
      : { kind: "ok" }
  );
  const waiter = await createJobWaiter({ sql: db.sql, log: silentLogger });
  const validators = createSchemaValidators();
  const api = apiHandler({ redis: r.redis, sql: db.sql, keys }, {
    authMode: "api-key",
    waiter,
    validate: validators.validate,
    validateNow: validators.validateNow,
  });
  const call = jsonClient(api, await createApiKey(db.sql, "acme"));
  const other = jsonClient(api, await createApiKey(db.sql, "globex"));
  const llm = createOpenAiLlm({ apiKey: "sk-test", model: "m", baseURL: model.url });
  const worker = summaryWorker({ redis: r.redis, sql: db.sql, llm, keys, validators });
  const stop = new AbortController();
  const running = worker.run(stop.signal);
  const schemaOf = (properties: Record<string, unknown>) => ({
    type: "object",
    properties,
    required: Object.keys(properties),
    additionalProperties: false,
  });
  try {
    await t.step("PUT: overlapping repetitions and a look-ahead are a 422 naming the pattern", async () => {
      const overlapping = await call("PUT", "/v1/tasks/overlap", {
        prompt: "Look at {{input.code}}",
        input_schema: schemaOf({ code: { type: "string", pattern: "^\\d*\\d*x" } }),
      });
      assert.equal(overlapping.status, 422, JSON.stringify(overlapping.body));
      assert.equal(overlapping.body.errors[0].pointer, "/input_schema/properties/code/pattern");
      assert.match(overlapping.body.errors[0].message, /\\d\* and \\d\* can match the same character/);
      const lookahead = await call("PUT", "/v1/tasks/lookahead", {
        prompt: "Look at {{input.n}}",
        input_schema: schemaOf({ n: { type: "integer" } }),
        output_schema: schemaOf({ code: { type: "string", pattern: "^(?=\\d)\\d+$" } }),
      });
      assert.equal(lookahead.status, 422, JSON.stringify(lookahead.body));
      assert.equal(lookahead.body.errors[0].pointer, "/output_schema/properties/code/pattern");
      assert.match(lookahead.body.errors[0].message, /look-around \(RE2 has none\)/);
      assert.equal((await call("GET", "/v1/tasks/overlap")).status, 404, "nothing stored");
    });

    for (
      const [name, body] of Object.entries({
        "stall-in": {
          prompt: "Look at {{input.code}}",
          input_schema: schemaOf({ code: { type: "string", pattern: SEPARATED } }),
        },
        "stall-out": {
          prompt: "Stall on {{input.n}}",
          input_schema: schemaOf({ n: { type: "integer" } }),
          output_schema: schemaOf({ code: { type: "string", pattern: SEPARATED } }),
        },
      })
    ) {
      assert.equal((await call("PUT", `/v1/tasks/${name}`, body)).status, 201, `the checks accept ${name}`);
    }
    assert.equal(
      (await other("PUT", "/v1/tasks/quick", {
        prompt: "Quick {{input.n}}",
        input_schema: schemaOf({ n: { type: "integer" } }),
        output_schema: schemaOf({ ok: { type: "boolean" } }),
      })).status,
      201,
    );

    await t.step("intake: 40 inputs of 200 digits are answered at once, and another tenant is served", async () => {
      const started = performance.now();
      const [flood, quick] = await Promise.all([
        Promise.all(
          Array.from({ length: 40 }, (_, i) =>
            call("POST", "/v1/tasks/stall-in/runs", { input: { code: DIGITS } }, {
              "idempotency-key": `stall-intake-${String(i).padStart(4, "0")}`,
            })),
        ),
        other("POST", "/v1/tasks/quick/runs", { input: { n: 1 } }, { "idempotency-key": "quick-intake-0001" }),
      ]);
      // Not a speed check: on V8 the first of them would never have been answered.
      assert.ok(performance.now() - started < 5_000, `${(performance.now() - started).toFixed(0)} ms`);
      for (const res of flood) {
        assert.equal(res.status, 422, JSON.stringify(res.body));
        assert.equal(res.body.errors[0].pointer, "/input/code");
        assert.equal(res.body.errors[0].message, "String does not match pattern.");
      }
      assert.equal(quick.status, 202);
      const matching = await call("POST", "/v1/tasks/stall-in/runs", { input: { code: `${"1.".repeat(9)}1x` } }, {
        "idempotency-key": "stall-intake-match",
      });
      assert.equal(matching.status, 202, JSON.stringify(matching.body));
    });

    await t.step("worker: an answer of 200 digits is judged at once: one repair call, then failed", async () => {
      const slow = await call("POST", "/v1/tasks/stall-out/runs", { input: { n: 1 } }, {
        "idempotency-key": "stall-worker-0001",
      });
      assert.equal(slow.status, 202);
      const quick = await Promise.all(
        Array.from({ length: 5 }, (_, i) =>
          other("POST", "/v1/tasks/quick/runs", { input: { n: i + 10 } }, {
            "idempotency-key": `quick-worker-000${i}`,
            prefer: "wait=10",
          })),
      );
      for (const q of quick) assert.equal(q.body.status, "done");
      const failed = await waitFor("the stalling run to fail", async () => {
        const run = await call("GET", `/v1/runs/${slow.body.run_id}`, undefined);
        return run.body.status === "failed" ? run.body : undefined;
      }, 15_000);
      assert.equal(failed.error, 'output_invalid: at "/code"');
      const calls = model.prompts.filter((p) => p.startsWith("Stall") || p.startsWith("That answer"));
      assert.deepEqual(calls.map((p) => p.split(" ")[0]), ["Stall", "That"], "a verdict: the repair call, once");
    });

    await t.step(
      "worker: a stored output schema this release cannot run fails the run before any model call",
      async () => {
        // Accepted by an earlier release (a count over 1,000 is no RE2 expression): planted as it was stored.
        const definition = {
          prompt: "Old {{input.n}}",
          input_schema: schemaOf({ n: { type: "integer" } }),
          output_schema: schemaOf({ code: { type: "string", pattern: "^.{0,5000}$" } }),
          max_output_tokens: 1024,
        };
        await db.sql`INSERT INTO tasks (tenant, name, version, definition)
        VALUES ('acme', 'old-pattern', 1, ${db.sql.json(definition as never)})`;
        const run = await call("POST", "/v1/tasks/old-pattern/runs", { input: { n: 1 } }, {
          "idempotency-key": "old-pattern-0001",
        });
        assert.equal(run.status, 202);
        const failed = await waitFor("the run to fail", async () => {
          const doc = await call("GET", `/v1/runs/${run.body.run_id}`, undefined);
          return doc.body.status === "failed" ? doc.body : undefined;
        }, 15_000);
        assert.equal(failed.error, "failed");
        const [outcome] = await db.sql<{ error: string }[]>`
        SELECT error FROM job_outcomes WHERE job_id = ${run.body.run_id}::uuid`;
        assert.match(outcome!.error, /cannot be run by this release .*PUT a new version/);
        assert.equal(model.prompts.filter((p) => p.startsWith("Old")).length, 0, "no model call was paid for");
      },
    );
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
