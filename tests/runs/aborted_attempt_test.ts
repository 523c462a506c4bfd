/**
 * A model call cut off by a worker's stop (its grace over, the handler
 * aborted) is still one call: it may have been billed, so it is a row of
 * `model_attempts` (outcome `aborted`, charged its reservation), and the
 * job is neither lost nor counted as a failure of its document.
 */
import assert from "node:assert/strict";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { failedAttemptsOf, taskAttemptUsage } from "../../src/jobs/job_store.ts";
import { createPrices } from "../../src/llm/prices.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { startFakeModel } from "../support/fake_model_server.ts";
import { enqueueToLane } from "../support/enqueue.ts";
import { summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

Deno.test("a model call aborted by a worker's stop is recorded as an aborted attempt, charged its reservation", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const model = startFakeModel(() => ({ kind: "hang" }));
  try {
    const keys = serviceKeys(r.prefix);
    const llm = createOpenAiLlm({ apiKey: "k", model: "priced-model", baseURL: model.url });
    const worker = summaryWorker({
      redis: r.redis,
      sql: db.sql,
      llm,
      keys,
      prices: createPrices({ LLM_PRICES: { "priced-model": { in: 1, out: 2 } } }),
    }, {
      graceMs: 200,
      job: {
        model: "priced-model",
        budgetMs: 60_000,
        perCallTimeoutMs: 30_000,
        maxAttempts: 3,
        backoffBaseMs: 1,
        backoffCapMs: 5,
      },
    });
    const jobId = crypto.randomUUID();
    await enqueueToLane(r.redis, keys, {
      jobId,
      tenant: "acme",
      request: { text: "Revenue rose. Costs fell.", notify: "ops@example.com" },
    });
    const stop = new AbortController();
    const running = worker.run(stop.signal);
    await waitFor("the model call in flight", () => model.prompts.length === 1);
    // The call hangs: the stop's grace runs out and the handler is aborted mid-call.
    stop.abort();
    await running;
    await worker.close(); // flushes the attempt log

    const rows = await db.sql<{ outcome: string; error: string | null; cost_usd: string | null; attempt: number }[]>`
      SELECT outcome, error, cost_usd::text, attempt FROM model_attempts WHERE job_id = ${jobId}`;
    assert.equal(rows.length, 1, JSON.stringify(rows));
    assert.equal(rows[0]!.outcome, "aborted");
    assert.equal(rows[0]!.attempt, 1);
    assert.ok(rows[0]!.error, "the row names what ended the call");
    // Charged as the budget charges it: the reservation (the worst case), never free.
    assert.ok(Number(rows[0]!.cost_usd) > 0, `cost_usd ${rows[0]!.cost_usd}`);
    // Not a failure of the document: a dead letter's reason does not count it, nor does the usage report.
    assert.equal((await failedAttemptsOf(db.sql, jobId))?.failed, 0);
    const [usage] = await taskAttemptUsage(db.sql, { tenant: "acme", sinceS: 3600 });
    assert.equal(usage?.calls, 1);
    assert.equal(usage?.failures, 0);
    // Not lost: still pending in its lane for another worker, and not decided.
    const lane = keys.lane("acme");
    const [pending] = await r.redis.xpending(lane.stream, lane.group) as [number];
    assert.equal(pending, 1);
    const [decided] = await db.sql`SELECT 1 FROM job_outcomes WHERE job_id = ${jobId}`;
    assert.equal(decided, undefined);
  } finally {
    await model.close();
    await r.close();
    await db.close();
  }
});
