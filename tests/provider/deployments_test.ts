/**
 * Several deployments through the router (`src/provider/deployments.ts`), each a real local provider speaking
 * OpenAI's wire format with its own limit, headers and outages, each model of each under its own shared flow in
 * Redis; runs through the real summary worker, effects counted in Postgres. The steps share one Redis and one
 * database, back to back, as production does.
 */
import assert from "node:assert/strict";
import { costNanos, createPrices } from "../../src/llm/prices.ts";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { createRouter, type RoutedDeployment } from "../../src/provider/deployments.ts";
import { createProviderFlow, type ProviderFlow, providerStateKey } from "../../src/provider/flow_control.ts";
import { putTaskVersion } from "../../src/jobs/task_store.ts";
import { listDeadLetters } from "../../src/queue/dead_letter.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { enqueueRunToLane } from "../support/enqueue.ts";
import {
  errorBody,
  type FakeModelServer,
  limitedProvider,
  type ModelBehaviour,
  startFakeModel,
} from "../support/fake_model_server.ts";
import { budgetsOn, summaryWorker } from "../support/fixtures.ts";
import { type Budgets, worstCaseTokens } from "../../src/budgets/budgets.ts";
import { readBudgetState } from "../../src/budgets/read_script.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { setTenantBudget } from "../../src/tenants/tenant_budgets.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

const CLASSIFY = {
  prompt: "Classify: {{input.body}}",
  model: ["primary", "backup"],
  input_schema: { type: "object", properties: { body: { type: "string" } }, required: ["body"] },
  max_output_tokens: 50,
};

const PRICES = createPrices({
  LLM_PRICES: { primary: { in: 10, out: 30 }, backup: { in: 0.5, out: 1.5 }, shared: { in: 1, out: 2 } },
});

Deno.test("deployments: spread by weight within limits, an outage avoided, fallback only when a model is unavailable", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const flows: ProviderFlow[] = [];
  const servers: FakeModelServer[] = [];
  let generation = 0;

  /** A deployment on its own fake server, serving `models`, each under its own flow. */
  const deployment = (
    name: string,
    respond: (n: number, prompt: string) => ModelBehaviour,
    models: string[],
    weight = 1,
  ): RoutedDeployment & { server: FakeModelServer } => {
    const server = startFakeModel(respond);
    servers.push(server);
    const apiKey = `sk-${name}-${generation}`;
    const own = new Map(models.map((model) => {
      const flow = createProviderFlow({ redis: r.redis, log: silentLogger }, {
        key: providerStateKey(r.prefix, { baseURL: server.url, model, apiKey }),
        cooldownMs: 1_000,
        probeLeaseMs: 5_000,
      });
      flows.push(flow);
      return [model, flow] as const;
    }));
    return {
      name,
      weight,
      server,
      flows: own,
      llm: createOpenAiLlm({ apiKey, model: models[0]!, baseURL: server.url }),
    };
  };

  /** Runs `jobs` runs of `task` (or the built-in summary) through one worker over `deployments`; stops once `until`. */
  async function drain(
    deployments: RoutedDeployment[],
    { jobs, task, fallbackAfterMs = 10_000, during, concurrency = 32, budgetUsdPerDay }: {
      jobs: number;
      /** Runs of the task `classify`, which accepts `primary`, then `backup`; the built-in summary when unset. */
      task?: boolean;
      fallbackAfterMs?: number;
      /** Runs while the worker drains, told the runs' tenant. */
      during?: (tenant: string) => Promise<void>;
      concurrency?: number;
      /** A USD budget per day for the runs' tenant, enforced by the worker (real budgets in Redis, limits in Postgres). */
      budgetUsdPerDay?: number;
    },
  ) {
    generation++;
    const fellBack: string[] = [];
    const models = createRouter({
      deployments,
      defaultModel: [...deployments[0]!.flows.keys()][0]!,
      fallbackAfterMs,
      fellBack: (from, to) => fellBack.push(`${from}->${to}`),
    });
    const tenant = `t${generation}`;
    let budgets: Budgets | undefined;
    if (budgetUsdPerDay !== undefined) {
      await createApiKey(db.sql, tenant);
      await setTenantBudget(db.sql, tenant, { "--usd-per-day": budgetUsdPerDay });
      budgets = budgetsOn({ redis: r.redis, sql: db.sql, keys }, { prices: PRICES, ttlMs: 200 });
    }
    const worker = summaryWorker({ redis: r.redis, sql: db.sql, models, keys, prices: PRICES, budgets }, {
      concurrency,
      job: { budgetMs: 60_000, perCallTimeoutMs: 5_000, maxAttempts: 4, backoffBaseMs: 20, backoffCapMs: 200 },
    });
    const ids: string[] = [];
    const version = task && (await putTaskVersion(db.sql, tenant, "classify", CLASSIFY)).task.version;
    for (let i = 0; i < jobs; i++) {
      const jobId = crypto.randomUUID();
      ids.push(jobId);
      await enqueueRunToLane(r.redis, keys, {
        jobId,
        tenant,
        run: task
          ? { task: "classify", version: version as number, input: { body: `Ticket ${i}: the export crashes.` } }
          : {
            task: "summarize",
            version: 1,
            input: { text: `Revenue rose ${i}%. Costs fell.` },
            notify: "ops@example.com",
          },
      }, { announce: i === jobs - 1 });
    }
    const stop = new AbortController();
    const started = performance.now();
    const running = worker.run(stop.signal);
    try {
      await during?.(tenant);
      await waitFor(`${jobs} runs committed`, async () => {
        const [row] = await db.sql<{ n: number }[]>`
          SELECT count(*)::int AS n FROM run_results WHERE run_id = ANY(${ids}::uuid[])`;
        return row!.n === jobs;
      }, 60_000);
      const seconds = (performance.now() - started) / 1000;
      // Attempts are recorded in the background, in batches: each run's successful one, once there.
      await waitFor("every run's successful attempt recorded", async () => {
        const [row] = await db.sql<{ n: number }[]>`
          SELECT count(*)::int AS n FROM model_attempts WHERE job_id = ANY(${ids}::uuid[]) AND outcome = 'ok'`;
        return row!.n === jobs;
      });
      const served = await db.sql<{ deployment: string; model: string; n: number }[]>`
        SELECT deployment, model, count(*)::int AS n FROM model_attempts
        WHERE job_id = ANY(${ids}::uuid[]) AND outcome = 'ok' GROUP BY 1, 2 ORDER BY 1, 2`;
      const [effects] = await db.sql<{ outbox: number; cost: string | null }[]>`
        SELECT (SELECT count(*) FROM outbox WHERE right(dedupe_key, 36) = ANY(${ids}::text[]))::int AS outbox,
               (SELECT sum(cost_usd)::text FROM model_attempts WHERE job_id = ANY(${ids}::uuid[])) AS cost`;
      const dead = await listDeadLetters(r.redis, keys.lane(tenant), 1_000);
      return {
        served: served.map((s) => ({ ...s })),
        outbox: effects!.outbox,
        dead: dead.length,
        fellBack,
        seconds,
        ids,
        tenant,
      };
    } finally {
      stop.abort();
      await running;
      await worker.close();
      await Promise.all(flows.map((f) => f.settled()));
    }
  }

  /**
   * Every run of `ids` done on its first delivery: each of its attempts (the failed ones before a fallback too)
   * recorded under delivery 1, its outcome `done`, nothing dead-lettered (a fallback spends no delivery).
   */
  async function assertFirstDelivery(ids: string[]) {
    const [row] = await db.sql<{ later: number; first: number; done: number }[]>`
      SELECT (SELECT count(*) FROM model_attempts WHERE job_id = ANY(${ids}::uuid[]) AND delivery <> 1)::int AS later,
             (SELECT count(DISTINCT job_id) FROM model_attempts
               WHERE job_id = ANY(${ids}::uuid[]) AND delivery = 1 AND outcome = 'ok')::int AS first,
             (SELECT count(*) FROM job_outcomes WHERE job_id = ANY(${ids}::uuid[]) AND outcome = 'done')::int AS done`;
    assert.equal(row!.later, 0, "no attempt of a later delivery");
    assert.equal(row!.first, ids.length, "every run served on its first delivery");
    assert.equal(row!.done, ids.length, "every run's outcome is done");
  }

  /** Waits until the failed attempts `deployment` answered for `ids` are recorded (in the background), and returns them. */
  async function failedOn(ids: string[], deployment: string, atLeast: number) {
    let rows: { outcome: string; status: number | null; delivery: number; model: string }[] = [];
    await waitFor(`${atLeast} failed attempts on ${deployment} recorded`, async () => {
      rows = await db.sql<typeof rows>`
        SELECT outcome, status, delivery, model FROM model_attempts
        WHERE job_id = ANY(${ids}::uuid[]) AND deployment = ${deployment} AND outcome <> 'ok'`;
      return rows.length >= atLeast;
    });
    return rows.map((row) => ({ ...row }));
  }

  try {
    await t.step(
      "weights 3 and 1 at limits of 15 and 5 req/s: split 3:1, no more 429s than learning costs",
      async () => {
        const fast = limitedProvider({ rps: 15 });
        const slow = limitedProvider({ rps: 5 });
        const a = deployment("a", fast.respond, ["shared"], 3);
        const b = deployment("b", slow.respond, ["shared"], 1);
        const result = await drain([a, b], { jobs: 120 });
        assert.equal(result.dead, 0);
        assert.equal(result.outbox, 120, "one notification a run");
        const byA = result.served.find((s) => s.deployment === "a")?.n ?? 0;
        const byB = result.served.find((s) => s.deployment === "b")?.n ?? 0;
        assert.equal(byA + byB, 120);
        assert.ok(Math.abs(byA / 120 - 0.75) <= 0.1, `split ${byA}:${byB}`);
        const limited = fast.counts.rateLimited + slow.counts.rateLimited;
        assert.ok(limited <= 0.02 * 120 + 2, `${limited} answers were 429`);
        assert.deepEqual(result.fellBack, []);
      },
    );

    await t.step("weights 3 and 1 at equal limits: the heavier one is never pushed past its limit", async () => {
      const one = limitedProvider({ rps: 10 });
      const two = limitedProvider({ rps: 10 });
      const a = deployment("a", one.respond, ["shared"], 3);
      const b = deployment("b", two.respond, ["shared"], 1);
      const result = await drain([a, b], { jobs: 120 });
      assert.equal(result.dead, 0);
      assert.ok(one.counts.rateLimited + two.counts.rateLimited <= 4, "a 429 or two while learning at most");
      // At 10 req/s a could not take 3/4 of a drain at 20 req/s: b took what a had no room for.
      const byB = result.served.find((s) => s.deployment === "b")?.n ?? 0;
      assert.ok(byB >= 120 * 0.3, `b served ${byB}`);
    });

    await t.step(
      "one of two deployments in a 503 outage: every run finishes on the other; it takes its share back once up",
      async () => {
        const down = limitedProvider({ rps: 50 });
        down.setOutage("503");
        const a = deployment("a", down.respond, ["shared"]);
        const b = deployment("b", limitedProvider({ rps: 50 }).respond, ["shared"]);
        const result = await drain([a, b], { jobs: 60 });
        assert.equal(result.dead, 0);
        assert.deepEqual(result.served, [{ deployment: "b", model: "shared", n: 60 }]);
        // The breaker opens after three distinct jobs' failures, then one probe a cooldown (1 s here, doubling).
        assert.ok(down.counts.unavailable <= 8, `${down.counts.unavailable} calls to the broken deployment`);
        const before = down.counts.unavailable;
        down.setOutage(null);
        const after = await drain([a, b], {
          jobs: 60,
          during: () => new Promise((resolve) => setTimeout(resolve, 100)),
        });
        assert.equal(after.dead, 0);
        const byA = after.served.find((s) => s.deployment === "a")?.n ?? 0;
        assert.ok(byA >= 15, `a served ${byA} of 60 after it recovered (${down.counts.unavailable - before} 503s)`);
      },
    );

    await t.step(
      "a 2 s rate_limit_exceeded pause of the only deployment of a model: waited for, no run falls back",
      async () => {
        let pausedUntil = 0;
        const primary = deployment("p", (n) => {
          if (n === 1) pausedUntil = performance.now() + 2_000;
          if (performance.now() < pausedUntil) {
            return {
              kind: "status",
              status: 429,
              headers: { "retry-after-ms": String(Math.ceil(pausedUntil - performance.now())) },
              body: errorBody("Rate limit reached on requests per min (RPM).", "requests", "rate_limit_exceeded"),
            };
          }
          return { kind: "ok" };
        }, ["primary"]);
        const backup = deployment("b", () => ({ kind: "ok" }), ["backup"]);
        const result = await drain([primary, backup], { jobs: 20, task: true });
        assert.equal(result.dead, 0);
        assert.deepEqual(result.served, [{ deployment: "p", model: "primary", n: 20 }]);
        assert.equal(backup.server.requests, 0, "no call fell back");
        assert.ok(result.seconds >= 1.5, `the pause was waited out (${result.seconds.toFixed(1)} s)`);
      },
    );

    await t.step(
      "the only deployment of a model out of quota: runs with a fallback finish on it at its price",
      async () => {
        const quota = limitedProvider({ rps: 50 });
        quota.setOutage("quota");
        const primary = deployment("p", quota.respond, ["primary"]);
        const backup = deployment("b", () => ({ kind: "ok", usage: { prompt_tokens: 100, completion_tokens: 10 } }), [
          "backup",
        ]);
        const result = await drain([primary, backup], { jobs: 20, task: true });
        assert.equal(result.dead, 0);
        assert.deepEqual(result.served, [{ deployment: "b", model: "backup", n: 20 }]);
        assert.ok(quota.counts.quota <= 3, `${quota.counts.quota} calls refused for quota`);
        assert.ok(result.fellBack.length >= 20 && result.fellBack.every((f) => f === "primary->backup"));
        const rows = await db.sql<{ model: string; cost: string }[]>`
        SELECT r.model, a.cost_usd::text AS cost FROM run_results r
        JOIN model_attempts a ON a.job_id = r.run_id AND a.outcome = 'ok'
        WHERE r.tenant = ${`t${generation}`}`;
        assert.equal(rows.length, 20);
        for (const row of rows) {
          assert.equal(row.model, "backup", "the run document names the model that served it");
          // 100 prompt tokens at $0.5/M and 10 completion tokens at $1.5/M: backup's price, not primary's.
          assert.equal(Number(row.cost), (100 * 0.5 + 10 * 1.5) / 1e6);
        }
      },
    );

    await t.step("runs without a fallback wait out the quota outage and finish once it recovers", async () => {
      const quota = limitedProvider({ rps: 50 });
      quota.setOutage("quota");
      const primary = deployment("p", quota.respond, ["primary"]);
      const backup = deployment("b", () => ({ kind: "ok" }), ["backup"]);
      const result = await drain([primary, backup], {
        jobs: 10,
        during: async () => {
          await new Promise((resolve) => setTimeout(resolve, 1_500));
          quota.setOutage(null);
        },
      });
      assert.equal(result.dead, 0);
      assert.deepEqual(result.served, [{ deployment: "p", model: "primary", n: 10 }]);
      assert.equal(backup.server.requests, 0);
      assert.deepEqual(result.fellBack, []);
    });
    /** A 429 `rate_limit_exceeded` answer asking the caller to wait `retryAfter` (the `retry-after` header, in seconds). */
    const rateLimited = (retryAfter: number): ModelBehaviour => ({
      kind: "status",
      status: 429,
      headers: { "retry-after": String(retryAfter) },
      body: errorBody("Rate limit reached on requests per min (RPM).", "requests", "rate_limit_exceeded"),
    });
    const BACKUP_USAGE = { prompt_tokens: 100, completion_tokens: 10 };
    /** One backup call's cost: 100 prompt tokens at $0.5/M and 10 completion tokens at $1.5/M (primary: $10 and $30). */
    const BACKUP_COST = (100 * 0.5 + 10 * 1.5) / 1e6;

    await t.step(
      "a 429 whose retry-after is longer than LLM_FALLBACK_AFTER_S falls back; a shorter one is waited for",
      async () => {
        // LLM_FALLBACK_AFTER_S = 2: a 30 s pause of the only deployment of primary makes primary unavailable.
        const primary = deployment("p", () => rateLimited(30), ["primary"]);
        const backup = deployment("b", () => ({ kind: "ok", usage: BACKUP_USAGE }), ["backup"]);
        const long = await drain([primary, backup], { jobs: 20, task: true, fallbackAfterMs: 2_000 });
        assert.equal(long.dead, 0);
        assert.deepEqual(long.served, [{ deployment: "b", model: "backup", n: 20 }]);
        assert.ok(
          long.fellBack.length >= 20 && long.fellBack.every((f) => f === "primary->backup"),
          `${long.fellBack}`,
        );
        // Each run asked primary at most once: after the first 429 the pause is in force for everyone.
        assert.ok(primary.server.requests >= 1 && primary.server.requests <= 20, `${primary.server.requests} calls`);
        // Each 429 is recorded under the deployment that answered it, absorbed by the flow control (`paused`).
        const limited = await failedOn(long.ids, "p", primary.server.requests);
        assert.ok(limited.every((a) => a.status === 429 && a.outcome === "paused" && a.model === "primary"));
        const rows = await db.sql<{ model: string; cost: string; deployment: string }[]>`
          SELECT r.model, a.cost_usd::text AS cost, a.deployment FROM run_results r
          JOIN model_attempts a ON a.job_id = r.run_id AND a.outcome = 'ok'
          WHERE r.run_id = ANY(${long.ids}::uuid[])`;
        assert.equal(rows.length, 20);
        for (const row of rows) {
          assert.deepEqual({ ...row, cost: Number(row.cost) }, { model: "backup", cost: BACKUP_COST, deployment: "b" });
        }
        await assertFirstDelivery(long.ids);

        // The same setting, a 1 s retry-after (shorter than 2 s): waited out on primary, no run falls back.
        let pausedUntil = 0;
        let answered429 = 0;
        const brief = deployment("p", (n) => {
          if (n === 1) pausedUntil = performance.now() + 1_000;
          if (performance.now() < pausedUntil) {
            answered429++;
            return rateLimited(1);
          }
          return { kind: "ok" };
        }, ["primary"]);
        const backup2 = deployment("b", () => ({ kind: "ok" }), ["backup"]);
        const short = await drain([brief, backup2], { jobs: 20, task: true, fallbackAfterMs: 2_000 });
        assert.equal(short.dead, 0);
        assert.ok(answered429 >= 1);
        assert.deepEqual(short.served, [{ deployment: "p", model: "primary", n: 20 }]);
        assert.equal(backup2.server.requests, 0, "no call fell back");
        assert.deepEqual(short.fellBack, []);
        await assertFirstDelivery(short.ids);
      },
    );

    await t.step(
      "a key refused (401, then 403) on the only deployment of a model: runs fall back to the next",
      async () => {
        for (const status of [401, 403]) {
          const refused = deployment("p", () => ({
            kind: "status",
            status,
            body: status === 401
              ? errorBody("Incorrect API key provided: sk-****.", "invalid_request_error", "invalid_api_key")
              : errorBody("You are not allowed to access this model.", "invalid_request_error", "model_not_allowed"),
          }), ["primary"]);
          const backup = deployment("b", () => ({ kind: "ok", usage: BACKUP_USAGE }), ["backup"]);
          const result = await drain([refused, backup], { jobs: 20, task: true });
          assert.equal(result.dead, 0, `${status}`);
          assert.deepEqual(result.served, [{ deployment: "b", model: "backup", n: 20 }], `${status}`);
          assert.ok(result.fellBack.length >= 20 && result.fellBack.every((f) => f === "primary->backup"));
          // Before the breaker opened, the runs already under way each asked once; then a probe a cooldown (1 s,
          // doubling) at most.
          assert.ok(refused.server.requests >= 1 && refused.server.requests <= 20 + 4, `${refused.server.requests}`);
          const failed = await failedOn(result.ids, "p", 1);
          assert.ok(failed.every((a) => a.status === status && a.outcome === "paused"), JSON.stringify(failed));
          const models = await db.sql<{ model: string }[]>`
          SELECT model FROM run_results WHERE run_id = ANY(${result.ids}::uuid[])`;
          assert.deepEqual(new Set(models.map((m) => m.model)), new Set(["backup"]));
          await assertFirstDelivery(result.ids);
        }
      },
    );

    await t.step(
      "two deployments of a model, one paused (a long 429) or down (503): all go to the other, none falls back",
      async () => {
        for (const trouble of ["paused", "503"] as const) {
          const down = limitedProvider({ rps: 50 });
          if (trouble === "503") down.setOutage("503");
          // Paused: a 30 s retry-after, past LLM_FALLBACK_AFTER_S (2 s), which alone would make it unavailable.
          const sick = deployment(
            "p1",
            (n, prompt) => trouble === "paused" ? rateLimited(30) : down.respond(n, prompt),
            [
              "primary",
            ],
          );
          const well = deployment("p2", () => ({ kind: "ok" }), ["primary"]);
          const backup = deployment("b", () => ({ kind: "ok" }), ["backup"]);
          const result = await drain([sick, well, backup], { jobs: 40, task: true, fallbackAfterMs: 2_000 });
          assert.equal(result.dead, 0, trouble);
          assert.deepEqual(result.served, [{ deployment: "p2", model: "primary", n: 40 }], trouble);
          assert.equal(backup.server.requests, 0, `${trouble}: no call fell back`);
          assert.deepEqual(result.fellBack, []);
          // Paused: one call at most per run before the pause was known; down: the breaker's bound, as above.
          const bound = trouble === "paused" ? 20 : 8;
          assert.ok(sick.server.requests <= bound, `${trouble}: ${sick.server.requests} calls to the sick deployment`);
          await assertFirstDelivery(result.ids);
        }
      },
    );

    await t.step(
      "under a USD budget, a fallback is reserved and charged at the fallback model's price",
      async () => {
        const refused = deployment("p", () => ({
          kind: "status",
          status: 401,
          body: errorBody("Incorrect API key provided: sk-****.", "invalid_request_error", "invalid_api_key"),
        }), ["primary"]);
        // The backup's answer comes after 1.5 s: long enough to read the reservation held for its call.
        const backup = deployment("b", () => ({ kind: "ok", usage: BACKUP_USAGE, delayMs: 1_500 }), ["backup"]);
        let heldNanos = -1;
        const one = await drain([refused, backup], {
          jobs: 1,
          task: true,
          budgetUsdPerDay: 5,
          during: async (tenant) => {
            await waitFor("the backup's call under way", () => Promise.resolve(backup.server.requests === 1));
            heldNanos = (await readBudgetState(r.redis, keys.budget(tenant))).reserved[1];
          },
        });
        assert.deepEqual(one.served, [{ deployment: "b", model: "backup", n: 1 }]);
        assert.deepEqual(one.fellBack, ["primary->backup"]);
        // The reservation held during the backup's call: the call's worst case at backup's price, not primary's.
        const sent = backup.server.bodies[0]!.messages as { content: string }[];
        const worst = worstCaseTokens(sent.map((m) => m.content), CLASSIFY.max_output_tokens);
        const atBackup = costNanos(PRICES.of("backup")!, worst.prompt, worst.completion);
        const atPrimary = costNanos(PRICES.of("primary")!, worst.prompt, worst.completion);
        assert.equal(heldNanos, atBackup, `held ${heldNanos} nano-USD (backup ${atBackup}, primary ${atPrimary})`);

        // 20 runs: the budget's spend is what they cost at the backup's price, the refused calls charged nothing.
        const many = await drain([refused, backup], { jobs: 20, task: true, budgetUsdPerDay: 5 });
        for (const result of [one, many]) {
          assert.equal(result.dead, 0);
          await assertFirstDelivery(result.ids);
          const [row] = await db.sql<{ cost: string }[]>`
            SELECT sum(cost_usd)::text AS cost FROM model_attempts WHERE job_id = ANY(${result.ids}::uuid[])`;
          const state = await readBudgetState(r.redis, keys.budget(result.tenant));
          assert.equal(state.reserved[1], 0, "nothing held once done");
          const costNanosSum = Math.round(Number(row!.cost) * 1e9);
          assert.equal(costNanosSum, Math.round(BACKUP_COST * 1e9) * result.ids.length, "each at the backup's price");
          assert.equal(state.spent[1], costNanosSum, "the budget's spend is the attempts' cost_usd");
        }
      },
    );
  } finally {
    for (const s of servers) await s.close();
    await r.close();
    await db.close();
  }
});
