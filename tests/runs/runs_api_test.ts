/**
 * A summary job is also a run of the built-in summarize task: its id works
 * on /v1/runs/{id}, with the run document's shape, for GET and DELETE.
 */
import assert from "node:assert/strict";
import { createExtractiveLlm } from "../../src/llm/extractive.ts";
import type { LLM } from "../../src/llm/llm.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { apiHandler, summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

const TEXT = "Revenue rose 12% in Q3. Costs fell. The board approved the plan. Staff were told on Friday.";

Deno.test("a summary job is a run of summarize on /v1/runs/{id}", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const api = apiHandler({ redis: r.redis, sql: db.sql, keys }, { authMode: "api-key" });
  const acme = await createApiKey(db.sql, "acme");
  const prompts: string[] = [];
  const countingLlm: LLM = {
    complete(prompt, options) {
      prompts.push(prompt);
      return createExtractiveLlm().complete(prompt, options);
    },
  };
  const effects = async (jobId: string) => {
    const [row] = await db.sql<{ s: number; o: number }[]>`
      SELECT (SELECT count(*) FROM summaries WHERE job_id = ${jobId}::uuid)::int AS s,
        (SELECT count(*) FROM outbox WHERE payload->>'job_id' = ${jobId})::int AS o`;
    return [row!.s, row!.o];
  };
  const beta = await createApiKey(db.sql, "beta");
  const call = async (
    key: string,
    method: string,
    path: string,
    body?: unknown,
    headers: Record<string, string> = {},
  ) => {
    const res = await api(
      new Request(`http://api${path}`, {
        method,
        headers: { authorization: `Bearer ${key}`, "content-type": "application/json", ...headers },
        body: body === undefined ? undefined : JSON.stringify(body),
      }),
    );
    return { status: res.status, body: await res.json() };
  };
  const post = async (idempotencyKey: string) =>
    (await call(acme, "POST", "/v1/summaries", { text: TEXT, notify: "ops@example.com" }, {
      "idempotency-key": idempotencyKey,
    })).body.job_id as string;
  try {
    const done = await post("runs-api-done-0001");
    const cancelled = await post("runs-api-cancel-0001");

    await t.step("queued: the run document, and another tenant's run is unknown", async () => {
      const run = await call(acme, "GET", `/v1/runs/${done}`);
      assert.equal(run.status, 200);
      assert.deepEqual(run.body, {
        run_id: done,
        task: "summarize",
        version: 1,
        status: "queued",
        attempts: 0,
        tokens: { prompt: 0, completion: 0 },
      });
      assert.equal((await call(beta, "GET", `/v1/runs/${done}`)).status, 404);
      assert.equal((await call(acme, "GET", `/v1/runs/${crypto.randomUUID()}`)).status, 404);
    });

    await t.step("DELETE cancels a queued run, as on /v1/summaries", async () => {
      const res = await call(acme, "DELETE", `/v1/runs/${cancelled}`);
      assert.equal(res.status, 200);
      assert.equal(res.body.status, "cancelled");
      assert.equal(res.body.task, "summarize");
      assert.equal((await call(acme, "GET", `/v1/summaries/${cancelled}`)).body.status, "cancelled");
    });

    await t.step("done: the summary is the run's output, with its attempts and tokens by kind", async () => {
      const stop = new AbortController();
      const worker = summaryWorker({ redis: r.redis, sql: db.sql, llm: countingLlm, keys }, {
        consumer: "runs-api-test",
      });
      const running = worker.run(stop.signal);
      try {
        await waitFor("the job done", async () => (await call(acme, "GET", `/v1/runs/${done}`)).body.status === "done");
      } finally {
        stop.abort();
        await running;
        await worker.close();
      }
      const run = (await call(acme, "GET", `/v1/runs/${done}`)).body;
      const summary = (await call(acme, "GET", `/v1/summaries/${done}`)).body;
      assert.equal(run.output, summary.summary);
      assert.equal(run.attempts, summary.attempts ?? 0);
      assert.equal(run.tokens.prompt + run.tokens.completion, summary.tokens ?? 0);
      assert.equal((await call(acme, "DELETE", `/v1/runs/${done}`)).status, 409);
      // Effects: one model call, one summary and one email for the done run; none for the cancelled one.
      assert.equal(prompts.length, 1, "one model call in all");
      assert.deepEqual(await effects(done), [1, 1]);
      assert.deepEqual(await effects(cancelled), [0, 0]);
    });
  } finally {
    await r.close();
    await db.close();
  }
});
