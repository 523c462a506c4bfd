/**
 * Tenants share one worker and the model provider fairly: the real summary
 * worker (lanes, the shared flow control, the `openai` SDK over HTTP to a
 * local fake provider), the real API handler for the POSTs, real Redis and
 * Postgres. Times are measured from outside, as a client would: from each
 * POST's answer until polling the database finds the job's summary.
 */
import assert from "node:assert/strict";
import { tenantCommand } from "../../src/cli/tenant_command.ts";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { createProviderFlow, providerStateKey } from "../../src/provider/flow_control.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { createTenantWeights, setTenantWeight } from "../../src/tenants/tenant_weights.ts";
import type { Sql } from "postgres";
import { type ModelBehaviour, startFakeModel } from "../support/fake_model_server.ts";
import { apiHandler, summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";
import { documentOf, tokenLimitedProvider } from "./token_limited_provider.ts";

Deno.test("tenants share one worker and the provider fairly", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  let run = 0;

  /** A worker with `concurrency` slots against a fake model answering with `respond`, and the API in front. */
  function service(respond: (n: number, prompt: string) => ModelBehaviour, concurrency: number) {
    const keys = serviceKeys(`${r.prefix}:run${run++}`);
    const model = startFakeModel(respond);
    // Nothing configured: the limits are learned from the provider's headers, as in production.
    const flow = createProviderFlow({ redis: r.redis, log: silentLogger }, {
      key: providerStateKey(keys.prefix, { baseURL: model.url, model: "m", apiKey: "sk-test" }),
      cooldownMs: 30_000,
      probeLeaseMs: 10_000,
    });
    const worker = summaryWorker({
      redis: r.redis,
      sql: db.sql,
      llm: createOpenAiLlm({ apiKey: "sk-test", model: "m", baseURL: model.url }),
      keys,
      flow,
    }, {
      concurrency,
      // The worker process's own read interval: wake-ups, not a fast poll, must bring new work in.
      blockMs: 1_000,
      graceMs: 100,
      job: { budgetMs: 60_000, perCallTimeoutMs: 30_000, maxAttempts: 4 },
    });
    const handler = apiHandler({ redis: r.redis, sql: db.sql, keys });
    const stop = new AbortController();
    let running: Promise<void> | undefined;
    return {
      start() {
        running ??= worker.run(stop.signal);
      },
      /** POSTs a document as `tenant`; resolves with the job id once the API has answered 202. */
      async post(tenant: string, text: string): Promise<string> {
        const res = await handler(
          new Request("http://api/v1/summaries", {
            method: "POST",
            headers: {
              "x-tenant-id": tenant,
              "content-type": "application/json",
              "idempotency-key": `fair-share-${crypto.randomUUID()}`,
            },
            body: JSON.stringify({ text, notify: "ops@example.com" }),
          }),
        );
        assert.equal(res.status, 202);
        return (await res.json()).job_id;
      },
      async close() {
        stop.abort();
        await running;
        await worker.close();
        await model.close();
      },
    };
  }

  /** Jobs among `ids` with a summary, as a client polling the database sees them. */
  async function done(ids: string[]): Promise<number> {
    const [row] = await db.sql<{ n: number }[]>`SELECT count(*)::int AS n FROM summaries WHERE job_id = ANY(${ids})`;
    return row!.n;
  }

  /** Seconds from `postedAt` until every job of `ids` has a summary, polling every 10 ms. */
  async function secondsUntilDone(ids: string[], postedAt: number, timeoutMs: number): Promise<number> {
    await waitFor(`${ids.length} jobs done`, async () => (await done(ids)) === ids.length, timeoutMs);
    return (performance.now() - postedAt) / 1000;
  }

  async function doneBy(tenant: string, since: Date): Promise<number> {
    const [row] = await db.sql<{ n: number }[]>`
      SELECT count(*)::int AS n FROM summaries WHERE tenant = ${tenant} AND created_at >= ${since}`;
    return row!.n;
  }

  try {
    // The API answers only for tenants that exist.
    for (const tenant of ["a", "b", "heavy", "light"]) await createApiKey(db.sql, tenant);

    await t.step(
      "A's 240 queued 250 ms jobs on one worker with 8 slots: B's 8 jobs are done within 1 s of their POSTs",
      async () => {
        const s = service(() => ({ kind: "ok", delayMs: 250 }), 8);
        const since = new Date();
        s.start();
        try {
          const backlog: string[] = [];
          for (let i = 0; i < 240; i++) backlog.push(await s.post("a", `Report ${i}. Revenue rose. Costs fell.`));
          await waitFor("A under way", async () => (await done(backlog)) >= 16, 10_000);
          const seconds: number[] = [];
          for (let round = 0; round < 3; round++) {
            const ids = await Promise.all(
              Array.from({ length: 8 }, (_, i) => s.post("b", `Note ${round}-${i}. Churn fell. Margins rose.`)),
            );
            const postedAt = performance.now();
            seconds.push(await secondsUntilDone(ids, postedAt, 10_000));
            await new Promise((res) => setTimeout(res, 100 + Math.random() * 200));
          }
          const aDone = await doneBy("a", since);
          console.log(`B's 8 done after ${seconds.map((x) => x.toFixed(2)).join(", ")} s; A done ${aDone}/240`);
          assert.ok(aDone < 240, "A still had a backlog when B was done");
          for (const x of seconds) assert.ok(x <= 1, `B's 8 jobs took ${x.toFixed(2)} s (bound 1 s)`);
        } finally {
          await s.close();
        }
      },
    );

    await t.step(
      "under 60,000 tokens/min, B's 20 small documents posted behind A's 100 large ones are done within 15 s",
      async () => {
        const provider = tokenLimitedProvider({ tpm: 60_000 });
        const s = service(provider.respond, 32);
        const since = new Date();
        s.start();
        try {
          for (let i = 0; i < 100; i++) await s.post("a", documentOf(4_000, `A${i}`));
          const postedAt = performance.now();
          const ids = await Promise.all(Array.from({ length: 20 }, (_, i) => s.post("b", documentOf(100, `B${i}`))));
          const seconds = await secondsUntilDone(ids, postedAt, 30_000);
          const aDone = await doneBy("a", since);
          console.log(
            `B's 20 done after ${seconds.toFixed(1)} s; A done ${aDone}; ` +
              `${provider.counts.ok} calls, ${provider.counts.rateLimited} answered 429, ${provider.counts.tokens} tokens`,
          );
          // Job-count round robin would let one of A's 4,000-token documents go with each of B's: about 80 s.
          assert.ok(seconds <= 15, `B's 20 jobs took ${seconds.toFixed(1)} s (bound 15 s)`);
          assert.ok(aDone >= 1, "A was served too");
        } finally {
          await s.close();
        }
      },
    );

    await t.step("weight 3 against weight 1, equal backlogs: completions split about 3:1", async () => {
      assert.equal(await tenantCommand(db.sql, ["set", "heavy", "--weight", "3"], () => {}), 0);
      const s = service(() => ({ kind: "ok", delayMs: 20 }), 4);
      const since = new Date();
      try {
        const ids: string[] = [];
        for (let i = 0; i < 100; i++) {
          ids.push(await s.post("heavy", `Heavy ${i}. Revenue rose. Costs fell.`));
          ids.push(await s.post("light", `Light ${i}. Revenue rose. Costs fell.`));
        }
        s.start();
        // A window of completions while both still have work: counts, not elapsed time.
        await waitFor("80 completions", async () => (await done(ids)) >= 80, 30_000);
        const heavy = await doneBy("heavy", since);
        const light = await doneBy("light", since);
        console.log(`weight 3: ${heavy}, weight 1: ${light}`);
        assert.ok(light < 100 && heavy < 100, "both still had a backlog");
        const ratio = heavy / light;
        assert.ok(ratio >= 2.4 && ratio <= 3.8, `heavy ${heavy} : light ${light} = ${ratio.toFixed(2)}, not about 3`);
      } finally {
        await s.close();
      }
    });

    await t.step("workers read the weights once per TTL, not per job: a change shows within it", async () => {
      let queries = 0;
      const counting = ((...args: Parameters<Sql>) => (queries++, db.sql(...args))) as unknown as Sql;
      let now = 0;
      const weights = createTenantWeights({ sql: counting, log: silentLogger }, { ttlMs: 10_000, now: () => now });
      assert.equal(await setTenantWeight(db.sql, "light", 7), true);
      assert.equal((await weights.current()).get("light"), 7, "the first read is waited for");
      assert.equal(await setTenantWeight(db.sql, "light", 2), true);
      for (let i = 0; i < 100; i++) assert.equal((await weights.current()).get("light"), 7);
      assert.equal(queries, 1);
      now += 10_000;
      await weights.current(); // stale: answered at once, read again behind it
      await waitFor("the second read", async () => (await weights.current()).get("light") === 2);
      assert.equal(queries, 2);
      assert.equal(await setTenantWeight(db.sql, "nobody", 2), false);
      await assert.rejects(() => setTenantWeight(db.sql, "light", 0), TypeError);
    });
  } finally {
    await r.close();
    await db.close();
  }
});
