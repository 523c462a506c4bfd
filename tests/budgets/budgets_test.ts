/**
 * Tenant budgets end to end: the real API handler and two real workers
 * (WORKER_CONCURRENCY=32 each) calling a fake model through the real openai
 * SDK; the fake reports token counts from the prompt's length, as a provider
 * does. The budget is enforced by reservations in Redis; the provider's own
 * count is what the test holds it to.
 */
import assert from "node:assert/strict";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { setTenantBudget } from "../../src/tenants/tenant_budgets.ts";
import { createLogger, silentLogger } from "../../src/log/logger.ts";
import { overLimit, warnUnpricedModels, worstCaseTokens } from "../../src/budgets/budgets.ts";
import { RESERVATION_EPOCH_MS } from "../../src/budgets/budget_hash.ts";
import { readBudgetState } from "../../src/budgets/read_script.ts";
import { runReserve } from "../../src/budgets/reserve_script.ts";
import { runSettle } from "../../src/budgets/settle_script.ts";
import { seedBudgetState } from "../../src/budgets/seed_script.ts";
import { taskModels } from "../../src/jobs/task_store.ts";
import { createPrices } from "../../src/llm/prices.ts";
import { createRegistry } from "../../src/metrics/metrics.ts";
import { budgetEvents } from "../../src/budgets/budget_metrics.ts";
import { startFakeModel } from "../support/fake_model_server.ts";
import { apiHandler, budgetRecords, budgetsOn, summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";
import { parseConfig } from "../../src/config.ts";
import { deployment, deploymentsEnv } from "../support/deployments_env.ts";

const TASK = {
  prompt: "Echo: {{input.text}}",
  input_schema: {
    type: "object",
    properties: { text: { type: "string" } },
    required: ["text"],
    additionalProperties: false,
  },
  max_output_tokens: 40,
};

/** What the fake provider reports for a prompt: about four characters a token, and 20 completion tokens. */
const usageOf = (prompt: string) => ({ prompt_tokens: Math.ceil(prompt.length / 4) + 8, completion_tokens: 20 });

/** A document of a fixed length, so every run costs the same. */
const doc = (tenant: string, i: number) => `${tenant} document ${String(i).padStart(4, "0")} `.padEnd(120, "x");

Deno.test("budgets: a tenant is stopped at its budget with 0 overshoot, waits, and goes on when it is raised", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  // Tokens the provider reported per tenant (the prompt names the tenant), and calls that hang for ever.
  const reported = new Map<string, number>();
  const model = startFakeModel((_, prompt) => {
    if (prompt.includes("[[hang]]")) return { kind: "hang" };
    if (prompt.includes("[[fail]]")) return { kind: "status", status: 400 };
    const usage = usageOf(prompt);
    const tenant = /^Echo: (\w+) /.exec(prompt)?.[1] ?? "?";
    reported.set(tenant, (reported.get(tenant) ?? 0) + usage.prompt_tokens + usage.completion_tokens);
    return { kind: "ok", usage, content: "ok", delayMs: 30 };
  });
  const prices = createPrices({ LLM_PRICES: { "default-model": { in: 0.4, out: 1.6 } } });
  const registry = createRegistry();
  const budgets = () =>
    budgetsOn({ redis: r.redis, sql: db.sql, keys }, { prices, ttlMs: 200, events: budgetEvents(registry) });
  const api = apiHandler({ redis: r.redis, sql: db.sql, keys }, {
    authMode: "api-key",
    budgets: budgets(),
    defaultModel: "default-model",
  });
  const tokens = new Map<string, string>();
  for (const tenant of ["acme", "other", "slow"]) tokens.set(tenant, await createApiKey(db.sql, tenant));
  const llm = createOpenAiLlm({ apiKey: "sk-test", model: "default-model", baseURL: model.url });
  const workers = [1, 2].map((n) =>
    summaryWorker({ redis: r.redis, sql: db.sql, llm, keys, budgets: budgets() }, {
      concurrency: 32,
      consumer: `w${n}`,
      job: { perCallTimeoutMs: 400, maxAttempts: 1, budgetMs: 5_000 },
    })
  );
  const stop = new AbortController();
  const running = workers.map((w) => w.run(stop.signal));
  const call = async (
    tenant: string,
    method: string,
    path: string,
    body?: unknown,
    headers: Record<string, string> = {},
  ) => {
    const res = await api(
      new Request(`http://api${path}`, {
        method,
        headers: { authorization: `Bearer ${tokens.get(tenant)}`, "content-type": "application/json", ...headers },
        body: body === undefined ? undefined : JSON.stringify(body),
      }),
    );
    return { status: res.status, headers: res.headers, body: await res.json() };
  };
  const post = (tenant: string, i: number, text = doc(tenant, i)) =>
    call(tenant, "POST", "/v1/tasks/echo/runs", { input: { text } }, {
      "idempotency-key": `${tenant}-run-${String(i).padStart(8, "0")}`,
    });
  const statuses = async (tenant: string) => {
    const rows = await db.sql<{ outcome: string; n: number }[]>`
      SELECT outcome, count(*)::int AS n FROM job_outcomes WHERE tenant = ${tenant} GROUP BY outcome`;
    return Object.fromEntries(rows.map((row) => [row.outcome, row.n])) as Record<string, number>;
  };
  // One run's cost as the provider counts it: the budget is worth exactly ten of them.
  const perRun = usageOf(`Echo: ${doc("acme", 0)}`);
  const perRunTokens = perRun.prompt_tokens + perRun.completion_tokens;
  const budget = 10 * perRunTokens;
  const worst = worstCaseTokens([`Echo: ${doc("acme", 0)}`], TASK.max_output_tokens);
  const worstRun = worst.prompt + worst.completion;
  try {
    for (const tenant of ["acme", "other", "slow"]) {
      const put = await call(tenant, "PUT", "/v1/tasks/echo", TASK);
      assert.equal(put.status, 201);
    }
    await setTenantBudget(db.sql, "acme", { "--tokens-per-day": budget });

    const ids: string[] = [];
    await t.step("64 runs against a budget worth 10: at most the budget is spent, the rest wait", async () => {
      const [acme, other] = await Promise.all([
        Promise.all(Array.from({ length: 64 }, (_, i) => post("acme", i))),
        Promise.all(Array.from({ length: 20 }, (_, i) => post("other", i))),
      ]);
      for (const a of [...acme, ...other]) assert.equal(a.status, 202, JSON.stringify(a.body));
      ids.push(...acme.map((a) => a.body.run_id as string));
      // Another tenant, posting at the same time, is served as if nothing happened.
      // What each wait last saw, for its message should it time out.
      let seen: unknown;
      const explain = (error: Error) => {
        throw new Error(`${error.message}; last seen: ${JSON.stringify(seen)}`);
      };
      await waitFor("the other tenant's 20 runs", async () => {
        seen = { other: await statuses("other"), acme: await statuses("acme") };
        return (await statuses("other")).done === 20;
      }, 20_000).catch(explain);
      // The budgeted tenant settles: nothing in flight, its runs held back.
      await waitFor("acme's runs held back for the budget", async () => {
        const state = await readBudgetState(r.redis, keys.budget("acme"));
        // A run not decided (the POSTs ran at once, so the last in `ids` may have been queued among the first).
        const decided = new Set((await db.sql<{ job_id: string }[]>`
          SELECT job_id::text FROM job_outcomes WHERE job_id = ANY(${ids}::uuid[])`).map((row) => row.job_id));
        const waiting = ids.find((id) => !decided.has(id));
        if (waiting === undefined) return false;
        const doc = await call("acme", "GET", `/v1/runs/${waiting}`);
        // Settled: nothing in flight, and what is left of the budget no longer fits one run's worst case.
        const done = (await statuses("acme")).done ?? 0;
        const queued = await r.redis.xlen(keys.lane("acme").stream);
        seen = { state, last: doc.body, done, queued, perRunTokens, worstRun, budget };
        return state.reserved[0] === 0 && state.spent[0]! + worstRun > budget && doc.body.status === "queued" &&
          doc.body.waiting_for === "budget" && done + queued === 64 &&
          // Every call charged belongs to a committed run (a settled call's run commits just after).
          state.spent[0] === done * perRunTokens;
      }, 20_000).catch(explain);
      const done = (await statuses("acme")).done ?? 0;
      console.log(`  ${done} of 64 runs finished within the budget`);
      assert.ok(done >= 1 && done <= 10, `${done} runs finished`);
      // 0 overshoot, by the provider's own count.
      assert.ok(reported.get("acme")! <= budget, `provider reported ${reported.get("acme")} tokens of ${budget}`);
      const state = await readBudgetState(r.redis, keys.budget("acme"));
      assert.equal(state.spent[0], reported.get("acme"), "the budget's spend is the provider's count, to the token");
      // The rest are queued, waiting for the budget, and none is failed or dead-lettered.
      const outcomes = await statuses("acme");
      assert.equal(outcomes.failed, undefined);
      assert.equal(await r.redis.xlen(keys.lane("acme").dead), 0);
      let waiting = 0;
      for (const id of ids) {
        const run = await call("acme", "GET", `/v1/runs/${id}`);
        if (run.body.status === "queued") {
          assert.equal(run.body.waiting_for, "budget");
          waiting++;
        } else assert.equal(run.body.status, "done");
      }
      assert.equal(waiting, 64 - done);
      // Waiting spent no deliveries: nothing of acme's is pending, every entry waits undelivered in the lane.
      const pending = await r.redis.xpending(keys.lane("acme").stream, keys.lane("acme").group) as [number];
      assert.equal(pending[0], 0);
      assert.equal(await r.redis.xlen(keys.lane("acme").stream), 64 - done);
    });

    await t.step(
      "GET /v1/usage shows the budget with the provider's count as spent, and this tenant's tokens",
      async () => {
        const usage = await call("acme", "GET", "/v1/usage?since=1h");
        assert.equal(usage.status, 200);
        assert.equal(usage.body.budgets.length, 1);
        const [view] = usage.body.budgets;
        assert.deepEqual([view.period, view.unit, view.limit, view.spent, view.reserved], [
          "day",
          "tokens",
          budget,
          reported.get("acme"),
          0,
        ]);
        // Attempts are recorded in batches, within a second.
        await waitFor("the attempts' record to hold every call", async () => {
          const { tokens } = (await call("acme", "GET", "/v1/usage?since=1h")).body.totals;
          return tokens.prompt + tokens.completion === reported.get("acme");
        });
        // Another tenant sees its own (none), never acme's.
        assert.deepEqual((await call("other", "GET", "/v1/usage")).body.budgets, []);
      },
    );

    await t.step("metrics: the 80% and 100% marks once each, spend and refusals per tenant", async () => {
      const text = await registry.metrics();
      const line = (name: string, labels: string) =>
        text.split("\n").find((l) => l.startsWith(`${name}{${labels}}`))?.split(" ").at(-1);
      assert.equal(
        line("oncely_budget_threshold_reached_total", 'tenant="acme",period="day",unit="tokens",percent="80"'),
        "1",
      );
      assert.equal(
        line("oncely_budget_threshold_reached_total", 'tenant="acme",period="day",unit="tokens",percent="100"'),
        "1",
      );
      assert.equal(
        line("oncely_budget_spent", 'tenant="acme",period="day",unit="tokens"'),
        String(reported.get("acme")),
      );
      assert.ok(Number(line("oncely_budget_refusals_total", 'tenant="acme",where="worker"')) >= 1);
    });

    await t.step("a new POST is refused with 429, Retry-After and the budget; a replay is still answered", async () => {
      const refused = await post("acme", 1000);
      assert.equal(refused.status, 429);
      const retryAfter = Number(refused.headers.get("retry-after"));
      assert.ok(retryAfter >= 1 && retryAfter <= 86_400, `Retry-After ${retryAfter}`);
      assert.equal(refused.body.title, "Budget exhausted");
      assert.equal(refused.body.budget.period, "day");
      assert.equal(refused.body.budget.unit, "tokens");
      assert.equal(refused.body.budget.limit, budget);
      assert.equal(refused.body.budget.spent, reported.get("acme"));
      const replay = await post("acme", 0);
      assert.equal(replay.status, 202);
      assert.equal(replay.headers.get("idempotent-replayed"), "true");
      // The other tenant still gets 202.
      assert.equal((await post("other", 1000)).status, 202);
    });

    await t.step("raising the budget lets the waiting runs finish", async () => {
      const started = performance.now();
      await setTenantBudget(db.sql, "acme", { "--tokens-per-day": 1_000_000 });
      await waitFor("all 64 of acme's runs done", async () => (await statuses("acme")).done === 64, 30_000);
      console.log(`  the waiting runs finished ${Math.round(performance.now() - started)} ms after the raise`);
      assert.equal(await r.redis.xlen(keys.lane("acme").dead), 0);
      // Each run made exactly one call.
      assert.equal(reported.get("acme"), 64 * perRunTokens);
    });

    await t.step("a call that times out after it was sent is charged its whole reservation", async () => {
      await setTenantBudget(db.sql, "slow", { "--tokens-per-month": 1_000_000 });
      await new Promise((resolve) => setTimeout(resolve, 300)); // past the budgets' 200 ms cache in this test
      const text = "slow [[hang]]";
      const posted = await post("slow", 1, text);
      assert.equal(posted.status, 202);
      const hung = worstCaseTokens([`Echo: ${text}`], TASK.max_output_tokens);
      await waitFor("the timed-out call's charge", async () => {
        const state = await readBudgetState(r.redis, keys.budget("slow"));
        return state.spent[2] === hung.prompt + hung.completion && state.reserved[2] === 0;
      }, 10_000);
      // A call the provider refused (a 400) is not billed: released, not charged.
      const before = (await readBudgetState(r.redis, keys.budget("slow"))).spent[2];
      assert.equal((await post("slow", 2, "slow [[fail]]")).status, 202);
      await waitFor("the refused run failed", async () => (await statuses("slow")).failed === 1, 10_000);
      const after = await readBudgetState(r.redis, keys.budget("slow"));
      assert.equal(after.spent[2], before);
      assert.equal(after.reserved[2], 0);
      // The hash is lost: rebuilt from model_attempts, the timed-out call counts at its charge (it counted 0).
      await waitFor("the attempts recorded", async () => {
        const [row] = await db.sql<{ n: number }[]>`
          SELECT count(*)::int AS n FROM model_attempts WHERE tenant = 'slow' AND charged_tokens IS NOT NULL`;
        return (row?.n ?? 0) >= 2;
      });
      await r.redis.del(keys.budget("slow"));
      const views = await budgets().views("slow");
      assert.equal(views[0]?.spent, hung.prompt + hung.completion);
    });
  } finally {
    stop.abort();
    await Promise.all(running);
    for (const w of workers) await w.close();
    await model.close();
    await r.close();
    await db.close();
  }
});

Deno.test("budget scripts: 200 reservations at once never pass the limit, and settle at the charge", async () => {
  const r = await createTestRedis();
  try {
    const key = serviceKeys(r.prefix).budget("t");
    const limits: [number, number, number, number] = [1_000, -1, -1, 5_000_000];
    const replies = await Promise.all(
      Array.from({ length: 200 }, () => runReserve(r.redis, key, limits, { tokens: 10, nanos: 30_000 })),
    );
    assert.equal(replies.filter((x) => x.ok).length, 100);
    const refused = replies.find((x) => !x.ok)!;
    assert.equal(refused.budget, 0); // tokens per day
    assert.equal(refused.spent, 0);
    assert.equal(refused.reserved, 1_000);
    const state = await readBudgetState(r.redis, key);
    assert.deepEqual(state.reserved, [1_000, 3_000_000, 1_000, 3_000_000]);
    // The intake's question ignores reservations: nothing is spent yet. The worker's counts them: it is refused.
    assert.equal(overLimit(limits, state.spent, undefined, { tokens: 10, nanos: 0 }), undefined);
    assert.deepEqual(overLimit(limits, state.spent, state.reserved, { tokens: 10, nanos: 0 }), {
      budget: 0,
      never: false,
    });
  } finally {
    await r.close();
  }
});

Deno.test("start-up names the models in use that have no price while a tenant has a USD budget", async () => {
  const db = await createTestDatabase();
  try {
    await createApiKey(db.sql, "acme");
    await db.sql`INSERT INTO tasks (tenant, name, version, definition)
      VALUES ('acme', 'triage', 1, ${db.sql.json({ prompt: "x", model: ["priced", "unpriced-b"] })})`;
    const config = { OPENAI_MODEL: "unpriced-a", LLM_PROVIDER: "openai" };
    const prices = createPrices({ LLM_PRICES: { priced: { in: 1, out: 2 } } });
    // No USD budget: nothing to say.
    const stores = { records: budgetRecords(db.sql), taskModels: () => taskModels(db.sql) };
    assert.deepEqual(await warnUnpricedModels({ ...stores, log: silentLogger }, config, prices), []);
    await setTenantBudget(db.sql, "acme", { "--usd-per-month": 10 });
    const lines: string[] = [];
    const log = createLogger({ level: "error", write: (line) => lines.push(line) });
    assert.deepEqual(await warnUnpricedModels({ ...stores, log }, config, prices), ["unpriced-a", "unpriced-b"]);
    assert.match(lines.join(""), /budget_models_unpriced/);
  } finally {
    await db.close();
  }
});

Deno.test("with LLM_DEPLOYMENTS, start-up names each deployment's model that has no price under a USD budget", async () => {
  const db = await createTestDatabase();
  try {
    await createApiKey(db.sql, "acme");
    await setTenantBudget(db.sql, "acme", { "--usd-per-day": 5 });
    const config = parseConfig(deploymentsEnv([
      deployment("east", { models: ["gpt-4.1-mini", "gpt-4.1"] }),
      deployment("local", { models: ["llama-3.1-8b"] }),
    ], { LLM_PRICES: '{"gpt-4.1-mini": {"in": 0.4, "out": 1.6}, "gpt-4.1": {"in": 2, "out": 8}}' }));
    const stores = { records: budgetRecords(db.sql), taskModels: () => taskModels(db.sql), log: silentLogger };
    // OPENAI_MODEL (gpt-4.1-mini by default) is priced, but the deployments may be asked for any model they list.
    assert.deepEqual(await warnUnpricedModels(stores, config, createPrices(config)), ["llama-3.1-8b"]);
  } finally {
    await db.close();
  }
});

Deno.test("a reservation never settled (its worker killed mid-call) is charged as spent an epoch later", async () => {
  const r = await createTestRedis();
  try {
    const key = serviceKeys(r.prefix).budget("t");
    const limits: [number, number, number, number] = [1_000, -1, -1, -1];
    await seedBudgetState(r.redis, key, [0, 0, 0, 0]);
    // A worker reserves, then is killed before it settles: its reservation is held, not spent.
    const held = await runReserve(r.redis, key, limits, { tokens: 300, nanos: 0 });
    assert.ok(held.ok);
    let state = await readBudgetState(r.redis, key);
    assert.equal(state.spent[0], 0);
    assert.equal(state.reserved[0], 300);
    // Two lease epochs later (the bucket moved back in time, as the clock would have moved on): read, it counts
    // as spent; the next reservation charges it for good.
    const old = held.epoch - 2;
    const dayOf = (epoch: number) => Math.floor(epoch * RESERVATION_EPOCH_MS / 86_400_000);
    if (dayOf(old) !== dayOf(held.epoch)) {
      console.log("  (within 30 minutes after UTC midnight: the forged epoch would be yesterday's; not checked now)");
      return;
    }
    const tokens = await r.redis.hget(key, `r${held.epoch}:tok`);
    await r.redis.hdel(key, `r${held.epoch}:tok`, `r${held.epoch}:usd`);
    await r.redis.hset(key, `r${old}:tok`, tokens!, "open", String(old), `R:${held.id}`, `${old},300,0`);
    state = await readBudgetState(r.redis, key);
    assert.deepEqual([state.spent[0], state.reserved[0]], [300, 0]);
    const next = await runReserve(r.redis, key, limits, { tokens: 800, nanos: 0 });
    assert.equal(next.ok, false, "300 charged + 800 would pass 1,000");
    assert.equal(next.spent, 300);
    assert.equal(await r.redis.hget(key, `r${old}:tok`), null);
    // The killed call's late settlement (say the call did answer, for 120 tokens) corrects the charge.
    const late = () =>
      runSettle(
        r.redis,
        key,
        { epoch: old, id: held.id },
        { tokens: 300, nanos: 0 },
        { tokens: 120, nanos: 0 },
        limits,
      );
    assert.equal((await late()).applied, true);
    state = await readBudgetState(r.redis, key);
    assert.deepEqual([state.spent[0], state.reserved[0]], [120, 0]);
    // Run again (a resend after a lost reply): the difference is not taken twice.
    assert.equal((await late()).applied, false);
    state = await readBudgetState(r.redis, key);
    assert.deepEqual([state.spent[0], state.reserved[0]], [120, 0]);
  } finally {
    await r.close();
  }
});

Deno.test("a budget's state lost in Redis (a flush, a failover) is rebuilt from the record before the next call", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  try {
    await createApiKey(db.sql, "acme");
    await setTenantBudget(db.sql, "acme", { "--tokens-per-day": 1_000 });
    // Today the tenant's calls used 800 tokens, as the worker recorded them.
    await db.sql`INSERT INTO model_attempts
      (job_id, tenant, delivery, attempt, started_at, duration_ms, outcome, prompt_tokens, completion_tokens, model)
      VALUES (${crypto.randomUUID()}, 'acme', 1, 1, now(), 10, 'ok', 500, 200, 'm'),
             (${crypto.randomUUID()}, 'acme', 1, 1, now(), 10, 'ok', 80, 20, 'm')`;
    const keys = serviceKeys(r.prefix);
    const budgets = budgetsOn({ redis: r.redis, sql: db.sql, keys }, { prices: createPrices({}), ttlMs: 200 });
    const key = keys.budget("acme");
    // No state in Redis at all (never made, or lost): a call worth 300 more does not fit the 200 left.
    await assert.rejects(budgets.reserve("acme", "m", { prompt: 250, completion: 50 }), /budget/i);
    assert.equal((await readBudgetState(r.redis, key)).spent[0], 800);
    // One worth 150 does, and is held.
    const held = await budgets.reserve("acme", "m", { prompt: 100, completion: 50 });
    assert.ok(held);
    // Redis loses the tenant's state again (the reservation with it): the next question rebuilds it first.
    await r.redis.del(key);
    assert.deepEqual((await budgets.views("acme")).map((v) => v.spent), [800]);
    await r.redis.del(key);
    assert.ok(await budgets.check("acme", "m", { prompt: 250, completion: 50 }), "refused at intake too");
    await r.redis.del(key);
    // The call of 150 is still in flight: the rebuilt hash holds it again before it decides, so another 150 no
    // longer fits (800 + 150 + 150), and 50 does.
    await assert.rejects(budgets.reserve("acme", "m", { prompt: 100, completion: 50 }), /budget/i);
    let state = await readBudgetState(r.redis, key);
    assert.deepEqual([state.spent[0], state.reserved[0], state.seeded], [800, 150, true]);
    assert.ok(await budgets.reserve("acme", "m", { prompt: 40, completion: 10 }));
    state = await readBudgetState(r.redis, key);
    assert.deepEqual([state.spent[0], state.reserved[0]], [800, 200]);
    await held.settle({ value: { text: "x", usage: { prompt_tokens: 100, completion_tokens: 20 } } } as never);
    state = await readBudgetState(r.redis, key);
    assert.deepEqual([state.spent[0], state.reserved[0]], [920, 50]);
  } finally {
    await r.close();
    await db.close();
  }
});

Deno.test("a call in flight when the budget's state is lost is charged in full by its settlement after the rebuild", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  try {
    await createApiKey(db.sql, "acme");
    await setTenantBudget(db.sql, "acme", { "--tokens-per-day": 10_000 });
    await db.sql`INSERT INTO model_attempts
      (job_id, tenant, delivery, attempt, started_at, duration_ms, outcome, prompt_tokens, completion_tokens, model)
      VALUES (${crypto.randomUUID()}, 'acme', 1, 1, now(), 10, 'ok', 600, 200, 'm')`;
    const keys = serviceKeys(r.prefix);
    const budgets = budgetsOn({ redis: r.redis, sql: db.sql, keys }, { prices: createPrices({}), ttlMs: 200 });
    const key = keys.budget("acme");
    // A call holds its worst case (3,000 tokens); Redis loses the hash meanwhile, and it is rebuilt (800 recorded).
    const held = (await budgets.reserve("acme", "m", { prompt: 1000, completion: 2000 }))!;
    await r.redis.del(key);
    assert.deepEqual((await budgets.views("acme")).map((v) => v.spent), [800]);
    // The call ends having used 1,100 tokens: all of it is spent in the rebuilt hash (before: 800 - 1,900, so 0).
    await held.settle({ value: { text: "x", usage: { prompt_tokens: 1000, completion_tokens: 100 } } } as never);
    const state = await readBudgetState(r.redis, key);
    assert.deepEqual([state.spent[0], state.reserved[0]], [1900, 0]);
  } finally {
    await r.close();
    await db.close();
  }
});
