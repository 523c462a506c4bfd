/**
 * Runs at their edges: a prompt that would render too large is refused at
 * intake; a cancel seen after a bad first answer stops the repair call; an
 * answer Postgres could not store is a bad answer (repaired), not a storage
 * failure; a validator that cannot answer is the server's fault (503), not
 * the input's.
 */
import assert from "node:assert/strict";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createJobWaiter } from "../../src/runs/job_waiter.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { RENDER_LIMITS, renderedChars, renderTemplate } from "../../src/tasks/definition.ts";
import { createSchemaValidators } from "../../src/tasks/validator.ts";
import { startFakeModel, STRUCTURED_MARKERS } from "../support/fake_model_server.ts";
import { apiHandler, summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

const OBJECT = (properties: Record<string, unknown>) => ({
  type: "object",
  properties,
  required: Object.keys(properties),
  additionalProperties: false,
});

Deno.test("renderedChars measures a template's rendering without rendering it", () => {
  const input = { a: "x".repeat(10), b: { c: [1, 2] } };
  for (const template of ["{{input.a}}{{input.a}} and {{ input.b }}", "no placeholder", "{{input.nope}}!"]) {
    assert.equal(renderedChars({ prompt: template }, input), renderTemplate(template, input).length);
  }
  assert.equal(renderedChars({ prompt: "{{input.a}}", system: "s {{input.b.c}}" }, input), 10 + 7);
});

Deno.test("runs at their edges", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const model = startFakeModel((_, prompt) => {
    if (prompt.startsWith("Slow")) return { kind: "ok", delayMs: 600 };
    if (prompt.startsWith("Nul")) return { kind: "ok", content: '{"note":"a\\u0000b"}' };
    return { kind: "ok" };
  });
  const waiter = await createJobWaiter({ sql: db.sql, log: silentLogger });
  const api = apiHandler({ redis: r.redis, sql: db.sql, keys }, { authMode: "api-key", waiter });
  const acme = await createApiKey(db.sql, "acme");
  const llm = createOpenAiLlm({ apiKey: "sk-test", model: "m", baseURL: model.url });
  const worker = summaryWorker({ redis: r.redis, sql: db.sql, llm, keys });
  const stop = new AbortController();
  const running = worker.run(stop.signal);
  const call = async (
    method: string,
    path: string,
    body?: unknown,
    headers: Record<string, string> = {},
    handler = api,
  ) => {
    const res = await handler(
      new Request(`http://api${path}`, {
        method,
        headers: { authorization: `Bearer ${acme}`, "content-type": "application/json", ...headers },
        body: body === undefined ? undefined : JSON.stringify(body),
      }),
    );
    return { status: res.status, headers: res.headers, body: await res.json() };
  };
  const put = async (name: string, prompt: string) =>
    assert.equal(
      (await call("PUT", `/v1/tasks/${name}`, {
        prompt,
        input_schema: OBJECT({ a: { type: "string" } }),
        output_schema: OBJECT({ note: { type: "string" } }),
      })).status,
      201,
    );
  try {
    await t.step("a prompt that would render past the limit is a 422 at intake, and nothing is queued", async () => {
      await put("echo", "{{input.a}}".repeat(2_000));
      const big = await call("POST", "/v1/tasks/echo/runs", { input: { a: "x".repeat(250) } }, {
        "idempotency-key": "edge-render-big-01",
      });
      assert.equal(big.status, 422);
      assert.equal(big.body.errors[0].pointer, "/input");
      assert.match(big.body.errors[0].message, new RegExp(`500000 characters; at most ${RENDER_LIMITS.maxChars}`));
      const small = await call("POST", "/v1/tasks/echo/runs", { input: { a: "x" } }, {
        "idempotency-key": "edge-render-small1",
      });
      assert.equal(small.status, 202);
    });

    await t.step("a cancel seen after a bad first answer stops the run before the repair call", async () => {
      await put("slow", `Slow {{input.a}}`);
      // Only this task's calls count (the previous step's run may call the model meanwhile).
      const slowCalls = () => model.prompts.filter((p) => p.startsWith("Slow") || p.startsWith("That answer")).length;
      const started = await call("POST", "/v1/tasks/slow/runs", { input: { a: STRUCTURED_MARKERS.breaksOnce } }, {
        "idempotency-key": "edge-cancel-repair1",
      });
      assert.equal(started.status, 202);
      const runId = started.body.run_id;
      // Cancel while the first (slow, bad) answer is on its way.
      await waitFor("the first call", () => slowCalls() > 0);
      assert.equal((await call("DELETE", `/v1/runs/${runId}`)).body.status, "cancelled");
      await waitFor("the delivery to end", () => worker.inFlight === 0, 5_000);
      await new Promise((r) => setTimeout(r, 200));
      assert.equal(slowCalls(), 1, "no repair call after the cancel");
      assert.equal((await call("GET", `/v1/runs/${runId}`)).body.status, "cancelled");
    });

    await t.step("an answer Postgres cannot store is repaired like any bad answer", async () => {
      await put("nul", `Nul {{input.a}}`);
      const nulCalls = () => model.prompts.filter((p) => p.startsWith("Nul") || p.startsWith("That answer")).length;
      const before = nulCalls();
      const done = await call("POST", "/v1/tasks/nul/runs", { input: { a: "x" } }, {
        "idempotency-key": "edge-unstorable-01",
        prefer: "wait=10",
      });
      assert.equal(done.body.status, "done", JSON.stringify(done.body));
      assert.deepEqual(done.body.output, { note: "x" });
      assert.equal(nulCalls() - before, 2);
      assert.ok(model.prompts.some((p) => /That answer cannot be stored/.test(p)));
    });

    await t.step("a validator that cannot answer is a 503 the client may retry, not a 422", async () => {
      const closed = createSchemaValidators();
      await closed.close();
      const broken = apiHandler({ redis: r.redis, sql: db.sql, keys }, {
        authMode: "api-key",
        validate: closed.validate,
        validateNow: closed.validateNow,
      });
      const res = await call("POST", "/v1/tasks/echo/runs", { input: { a: "y" } }, {
        "idempotency-key": "edge-validator-503",
      }, broken);
      assert.equal(res.status, 503);
      assert.equal(res.headers.get("retry-after"), "1");
    });
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
