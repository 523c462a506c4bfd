/**
 * Two summary workers, each with its own Redis client and SDK client as two
 * processes would have, against a local provider that enforces a shared
 * limit with OpenAI's headers and 429 bodies and can go down. Effects are
 * counted: model calls by answer, summary rows, outbox rows, dead letters.
 */
import assert from "node:assert/strict";
import { connectRedis, type RedisClient } from "../../src/clients.ts";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { createProviderFlow, providerStateKey } from "../../src/provider/flow_control.ts";
import { listDeadLetters } from "../../src/queue/dead_letter.ts";
import { ensureGroup } from "../../src/queue/stream_worker.ts";
import { enqueueJob } from "../support/enqueue.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { announceLane } from "../../src/queue/lanes.ts";
import { createSummaryWorker } from "../../src/runs/worker.ts";
import { createDeployment } from "../../src/provider/deployment.ts";
import { limitedProvider, startFakeModel } from "../support/fake_model_server.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

const RPS = 20;

Deno.test("two workers share one provider's limit, pause and breaker", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  // Every job is tenant acme's, in its lane.
  const service = serviceKeys(r.prefix);
  const keys = service.lane("acme");
  let run = 0;

  /** Runs `jobs` jobs through two workers; `during` may act while they run. */
  async function drain(
    { jobs, rpm, cooldownMs = 30_000, during }: {
      jobs: number;
      rpm?: number;
      cooldownMs?: number;
      during?: (provider: ReturnType<typeof limitedProvider>) => Promise<void>;
    },
  ) {
    await db.sql`TRUNCATE summaries, outbox`;
    await r.redis.del(keys.stream, keys.dead);
    await ensureGroup(r.redis, keys);
    const provider = limitedProvider({ rps: RPS });
    const model = startFakeModel(provider.respond);
    const stateKey = providerStateKey(r.prefix, { baseURL: model.url, model: `m${run++}`, apiKey: "sk-test" });
    const stop = new AbortController();
    const clients: RedisClient[] = [];
    const workers = [];
    for (const name of ["w1", "w2"]) {
      // Its own connection, as a second process would have (a cluster client on a cluster run).
      const redis = await connectRedis(r.url);
      clients.push(redis);
      const flow = createProviderFlow({ redis, log: silentLogger }, {
        key: stateKey,
        rpm,
        cooldownMs,
        probeLeaseMs: 5_000,
      });
      workers.push(createSummaryWorker({
        redis,
        sql: db.sql,
        models: createDeployment({
          llm: createOpenAiLlm({ apiKey: "sk-test", model: "m", baseURL: model.url }),
          flow,
          model: "m",
        }),
        log: silentLogger,
      }, {
        keys: service,
        consumer: name,
        claimIdleMs: 60_000,
        maxDeliveries: 5,
        concurrency: 32,
        blockMs: 50,
        job: { budgetMs: 20_000, perCallTimeoutMs: 5_000, maxAttempts: 4, backoffBaseMs: 50, backoffCapMs: 500 },
      }));
    }
    try {
      for (let i = 0; i < jobs; i++) {
        await enqueueJob(r.redis, keys, {
          jobId: crypto.randomUUID(),
          tenant: "acme",
          request: { text: `Revenue rose ${i}%. Costs fell.`, notify: "ops@example.com" },
        });
      }
      await announceLane(r.redis, service.registry, "acme");
      const running = workers.map((w) => w.run(stop.signal));
      await during?.(provider);
      const done = async () => {
        const [row] = await db.sql<{ s: number }[]>`SELECT count(*)::int AS s FROM summaries`;
        return row!.s === jobs;
      };
      await waitFor(`${jobs} summaries`, done, 60_000);
      stop.abort();
      await Promise.all(running);
      const [row] = await db.sql<{ s: number; o: number }[]>`
        SELECT (SELECT count(*) FROM summaries)::int AS s, (SELECT count(*) FROM outbox)::int AS o`;
      const dead = await listDeadLetters(r.redis, keys, 1_000);
      return { provider, summaries: row!.s, outbox: row!.o, dead: dead.length, calls: model.requests };
    } finally {
      stop.abort();
      for (const w of workers) await w.close();
      for (const c of clients) await c.quit();
      await model.close();
    }
  }

  try {
    await t.step("with LLM_RPM set, calls are paced under the provider's limit: no job is lost or dead", async () => {
      const result = await drain({ jobs: 60, rpm: RPS * 60 });
      assert.equal(result.summaries, 60);
      assert.equal(result.outbox, 60);
      assert.equal(result.dead, 0);
      assert.equal(result.provider.counts.ok, 60, "one successful call per job");
      assert.equal(result.calls, 60 + result.provider.counts.rateLimited);
      assert.ok(result.provider.counts.rateLimited <= 3, `${result.provider.counts.rateLimited} answered 429`);
    });

    await t.step("with nothing configured, the limit is learned from the headers", async () => {
      const result = await drain({ jobs: 60 });
      assert.equal(result.summaries, 60);
      assert.equal(result.outbox, 60);
      assert.equal(result.dead, 0);
      assert.equal(result.provider.counts.ok, 60);
      assert.ok(result.provider.counts.rateLimited <= 6, `${result.provider.counts.rateLimited} answered 429`);
    });

    for (const outage of ["quota", "503"] as const) {
      await t.step(
        `a ${outage} outage opens the breaker: calls stay bounded, no job is dead-lettered, all finish after`,
        async () => {
          let failedDuringOutage = 0;
          const result = await drain({
            jobs: 30,
            rpm: RPS * 60,
            cooldownMs: 300,
            during: async (provider) => {
              await waitFor("some jobs done", () => provider.counts.ok >= 10, 10_000);
              provider.setOutage(outage);
              await new Promise((res) => setTimeout(res, 1_500));
              failedDuringOutage = provider.counts.quota + provider.counts.unavailable;
              provider.setOutage(null);
            },
          });
          assert.equal(result.summaries, 30);
          assert.equal(result.outbox, 30);
          assert.equal(result.dead, 0, "no job is dead-lettered");
          assert.equal(result.provider.counts.ok, 30);
          // Calls in flight when it began (paced 50 ms apart, so one or two), the run that opens the breaker
          // (one for quota, three for 5xx), then one probe per cooldown: 300, 450, 600 ms fit in 1.5 s.
          const bound = (outage === "quota" ? 1 : 3) + 2 + 4;
          assert.ok(failedDuringOutage <= bound, `${failedDuringOutage} calls during the outage (bound ${bound})`);
          assert.ok(failedDuringOutage >= 2, "the probes did call");
        },
      );
    }
  } finally {
    await r.close();
    await db.close();
  }
});
