/**
 * Batch runs against tenant budgets (issue 43): a line has no reservation (the provider calls when it will), so
 * its usage is charged when its output is committed, at the model's batch prices, once however often the output
 * is read; and a run whose tenant's budget is spent is not collected into a batch. Real Redis and Postgres.
 */
import assert from "node:assert/strict";
import { createBatchPoller } from "../../src/batches/batch_poller.ts";
import { createBatchSubmitter } from "../../src/batches/batch_submitter.ts";
import { createPrices } from "../../src/llm/prices.ts";
import type { Models } from "../../src/llm/models.ts";
import { createGroupCommitter } from "../../src/runs/commit.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createSummaryJob } from "../../src/runs/run_job.ts";
import { SUMMARIZE_TASK, type TaskCache } from "../../src/tasks/task_cache.ts";
import { setTenantBudget } from "../../src/tenants/tenant_budgets.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { budgetsOn } from "../support/fixtures.ts";
import { createTestRedis } from "../_support.ts";
import { batchPayload, batchWorld, MODEL } from "./_fixture.ts";

const PRICE = { in: 2, out: 8, batch_in: 1, batch_out: 4 };

Deno.test("batch lines are charged to the tenant's budgets at batch prices, once however often the output is read", async () => {
  const world = await batchWorld({
    maxRuns: 3,
    script: () => ({ line: () => ({ kind: "ok", usage: { prompt_tokens: 1000, completion_tokens: 500 } }) }),
  });
  const r = await createTestRedis();
  try {
    await createApiKey(world.sql, "acme");
    await setTenantBudget(world.sql, "acme", { "--usd-per-day": 1, "--tokens-per-day": 1_000_000 });
    const keys = serviceKeys(r.prefix);
    const budgets = budgetsOn({ redis: r.redis, sql: world.sql, keys }, {
      prices: createPrices({ LLM_PRICES: { [MODEL]: PRICE } }),
    });
    await world.recordRuns(3);
    await createBatchSubmitter(world, { maxWaitMs: 3_600_000 }).runOnce();
    const poller = () =>
      createBatchPoller({ ...world, committer: createGroupCommitter({ sql: world.sql, log: world.log }) }, {
        onExpiry: "online",
        prices: createPrices({ LLM_PRICES: { [MODEL]: PRICE } }),
        budgets,
        leaseMs: 0,
      });
    assert.equal(await poller().runOnce(), 1);
    const spent = async () =>
      Object.fromEntries((await budgets.views("acme")).map((v) => [`${v.period}_${v.unit}`, v.spent]));
    // 1000 prompt and 500 completion tokens at $1 / $4 per Mtok: $0.003 a line (at the online prices: $0.006).
    assert.deepEqual(await spent(), { day_tokens: 4500, day_usd: 0.009 });
    // The whole output read again, as a process that died before recording `committed` would: charged once.
    await world.sql`UPDATE batches SET state = 'ended'`;
    await world.sql`UPDATE batch_runs SET settled = NULL`;
    assert.equal(await poller().runOnce(), 1);
    assert.deepEqual(await spent(), { day_tokens: 4500, day_usd: 0.009 });
    // The hash lost: rebuilt from `model_attempts`, where each line is one row at its batch price.
    await r.redis.del(keys.budget("acme"));
    assert.deepEqual(await spent(), { day_tokens: 4500, day_usd: 0.009 });
  } finally {
    await r.close();
    await world.close();
  }
});

Deno.test("a batch run whose tenant's budget is spent is not collected into a batch: it goes the online way", async () => {
  const world = await batchWorld();
  const r = await createTestRedis();
  try {
    await createApiKey(world.sql, "acme");
    await setTenantBudget(world.sql, "acme", { "--tokens-per-day": 1_000_000 });
    const budgets = budgetsOn({ redis: r.redis, sql: world.sql, keys: serviceKeys(r.prefix) }, {
      prices: createPrices({ LLM_PRICES: { [MODEL]: PRICE } }),
    });
    let online = 0;
    const models: Models = {
      defaultModel: MODEL,
      acquire: () => Promise.reject(new Error(`online call ${++online}`)),
    };
    const tasks = { peek: () => SUMMARIZE_TASK, get: () => Promise.resolve(SUMMARIZE_TASK) } as unknown as TaskCache;
    const job = createSummaryJob({
      sql: world.sql,
      models,
      log: world.log,
      committer: createGroupCommitter({ sql: world.sql, log: world.log }),
      tasks,
      budgets,
      batches: world.intake,
    }, { budgetMs: 5_000, perCallTimeoutMs: 1_000, maxAttempts: 1 });
    const message = () => ({
      id: `${Date.now()}-0`,
      fields: { job_id: crypto.randomUUID(), tenant: "acme", payload: batchPayload("Some text. More text.") },
      deliveries: 1,
    });
    const signal = new AbortController().signal;
    assert.equal(await job(message(), signal), "batched", "within its budget: collected");
    // The day's budget spent (by earlier batch lines, charged as the poller charges them).
    await budgets.charge("acme", MODEL, { prompt: 999_000, completion: 1_000 }, { id: "earlier", batch: true });
    await assert.rejects(job(message(), signal), /online call 1/);
    const [n] = await world.sql<{ n: number }[]>`SELECT count(*)::int AS n FROM batch_runs`;
    assert.equal(n!.n, 1, "the second run was not collected");
  } finally {
    await r.close();
    await world.close();
  }
});
