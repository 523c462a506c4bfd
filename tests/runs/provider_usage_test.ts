/**
 * Usage a provider reports is validated before anything trusts it: a
 * negative, fractional, string or absurd (`1e15`) token count is unknown
 * usage. The run the provider answered ends done, its attempt row has no
 * token counts and is charged its reservation (in `cost_usd` and against the
 * tenant's budget), and the other tenants' attempts written in the same
 * batch are kept. Through the real openai SDK, the fake model server, a real
 * worker, Redis and Postgres.
 */
import assert from "node:assert/strict";
import { worstCaseTokens } from "../../src/budgets/budgets.ts";
import { readBudgetState } from "../../src/budgets/read_script.ts";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { MAX_OUTPUT_TOKENS, summaryPrompt } from "../../src/llm/llm.ts";
import { createLogger, silentLogger } from "../../src/log/logger.ts";
import { costNanos, createPrices } from "../../src/llm/prices.ts";
import { createProviderFlow, providerStateKey } from "../../src/provider/flow_control.ts";
import { createRegistry, workerMetrics } from "../../src/metrics/metrics.ts";
import { flowEvents } from "../../src/processes/metrics_wiring.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { setTenantBudget } from "../../src/tenants/tenant_budgets.ts";
import { startFakeModel } from "../support/fake_model_server.ts";
import { enqueueToLane } from "../support/enqueue.ts";
import { budgetsOn, summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, recordingLogger, waitFor } from "../_support.ts";

/** The bad usages, each as a provider might send it: the marker in a document picks one. */
const BAD_USAGE: Record<string, Record<string, unknown>> = {
  negative: { prompt_tokens: -50, completion_tokens: 10, total_tokens: -40 },
  string: { prompt_tokens: "12", completion_tokens: "5", total_tokens: "17" },
  huge: { prompt_tokens: 1e15, completion_tokens: 10, total_tokens: 1e15 + 10 },
  fractional: { prompt_tokens: 0.5, completion_tokens: 10, total_tokens: 10.5 },
};

/** What every other call reports. */
const GOOD_USAGE = { prompt_tokens: 11, completion_tokens: 7 };

const PRICE = { in: 1, out: 2 };

Deno.test("usage out of range or not an integer is unknown: the run is done, others' rows kept", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  // Every call of a round is answered at the same moment, so their attempts land in one batch of the log.
  let answerAt = 0;
  const model = startFakeModel((_, prompt) => {
    if (answerAt === 0) answerAt = performance.now() + 150;
    const delayMs = Math.max(0, answerAt - performance.now());
    const marker = /\[\[usage:(\w+)\]\]/.exec(prompt)?.[1];
    return marker ? { kind: "ok", delayMs, rawUsage: BAD_USAGE[marker]! } : { kind: "ok", delayMs, usage: GOOD_USAGE };
  });
  const keys = serviceKeys(r.prefix);
  const prices = createPrices({ LLM_PRICES: { "priced-model": PRICE } });
  const logged = recordingLogger();
  const llm = createOpenAiLlm({
    apiKey: "sk-test",
    model: "priced-model",
    baseURL: model.url,
    log: createLogger({ level: "debug", write: logged.write }),
  });
  // The worker process's flow control, with its token metrics: both read the usage too.
  const registry = createRegistry();
  const flow = createProviderFlow({ redis: r.redis, log: silentLogger }, {
    key: providerStateKey(r.prefix, { baseURL: model.url, model: "priced-model", apiKey: "sk-test" }),
    cooldownMs: 1_000,
    probeLeaseMs: 5_000,
    events: flowEvents(workerMetrics(registry)),
  });
  const worker = summaryWorker({
    redis: r.redis,
    sql: db.sql,
    llm,
    keys,
    prices,
    flow,
    budgets: budgetsOn({ redis: r.redis, sql: db.sql, keys }, { prices }),
  }, { job: { model: "priced-model", maxAttempts: 1, budgetMs: 5_000, perCallTimeoutMs: 2_000 } });
  const others = ["globex", "initech", "umbrella"];
  for (const kind of Object.keys(BAD_USAGE)) {
    await createApiKey(db.sql, `bad-${kind}`);
    await setTenantBudget(db.sql, `bad-${kind}`, { "--tokens-per-day": 1_000_000 });
  }
  const stop = new AbortController();
  const running = worker.run(stop.signal);
  try {
    for (const [i, kind] of Object.keys(BAD_USAGE).entries()) {
      await t.step(`${kind} usage (${JSON.stringify(BAD_USAGE[kind]!.prompt_tokens)} prompt tokens)`, async () => {
        answerAt = 0;
        const tenant = `bad-${kind}`;
        const text = `The quarter closed well. Revenue rose. [[usage:${kind}]] Round ${i}.`;
        const jobs = [{ tenant, text }, ...others.map((other) => ({ tenant: other, text: `Round ${i} for ${other}.` }))]
          .map((job) => ({ ...job, jobId: crypto.randomUUID() }));
        for (const { jobId, tenant, text } of jobs) {
          await enqueueToLane(r.redis, keys, { jobId, tenant, request: { text, notify: "ops@example.com" } });
        }
        const ids = jobs.map((j) => j.jobId);
        // The provider answered every call: every run is done, the bad one too.
        const outcomes = await waitFor("every run decided", async () => {
          const rows = await db.sql<{ job_id: string; outcome: string }[]>`
            SELECT job_id::text, outcome FROM job_outcomes WHERE job_id = ANY(${ids}::uuid[])`;
          return rows.length === jobs.length ? rows : undefined;
        });
        assert.deepEqual(outcomes.map((o) => o.outcome), jobs.map(() => "done"), JSON.stringify(outcomes));
        const [summaries] = await db.sql<[{ n: number }]>`
          SELECT count(*)::int AS n FROM summaries WHERE job_id = ANY(${ids}::uuid[])`;
        assert.equal(summaries.n, jobs.length);

        // One attempt row per call, the other tenants' included: a bad row never costs the batch.
        const rows = await waitFor("every attempt written", async () => {
          const found = await db.sql<
            {
              job_id: string;
              tenant: string;
              outcome: string;
              prompt_tokens: number | null;
              completion_tokens: number | null;
              cost_usd: string;
            }[]
          >`SELECT job_id::text, tenant, outcome, prompt_tokens, completion_tokens, cost_usd::text
            FROM model_attempts WHERE job_id = ANY(${ids}::uuid[])`;
          return found.length === jobs.length ? found : undefined;
        }, 3_000);
        const bad = rows.find((row) => row.tenant === tenant)!;
        assert.equal(bad.outcome, "ok");
        assert.equal(bad.prompt_tokens, null, "no token counts for unknown usage");
        assert.equal(bad.completion_tokens, null);
        // Charged its reservation (the call's worst case), as a call that ran without reporting usage.
        const worst = worstCaseTokens([summaryPrompt(text)], MAX_OUTPUT_TOKENS);
        assert.equal(Number(bad.cost_usd), costNanos(PRICE, worst.prompt, worst.completion) / 1e9);
        for (const other of others) {
          const row = rows.find((r) => r.tenant === other);
          assert.ok(row, `${other}'s attempt row is kept`);
          assert.deepEqual([row.prompt_tokens, row.completion_tokens], [11, 7]);
        }
        // Logged once, with the value as the provider sent it.
        const lines = logged.lines.filter((line) => line.event === "provider_usage_invalid");
        assert.equal(lines.length, 1, JSON.stringify(lines));
        assert.equal(lines[0]!.field, "prompt_tokens");
        assert.equal(lines[0]!.value, JSON.stringify(BAD_USAGE[kind]!.prompt_tokens));
        logged.lines.length = 0;
        // The budget is charged the reservation too, and nothing stays reserved.
        const state = await readBudgetState(r.redis, keys.budget(tenant));
        assert.deepEqual([state.spent[0], state.reserved[0]], [worst.prompt + worst.completion, 0]);
      });
    }
  } finally {
    stop.abort();
    await running;
    await worker.close();
    await model.close();
    await r.close();
    await db.close();
  }
});
