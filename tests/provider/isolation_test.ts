/**
 * One bad document must not slow anyone else, and a provider-wide answer
 * stays provider-wide. A real summary worker with the shared flow control,
 * the real `openai` SDK and a local provider whose answer depends on the
 * document: `HANG-ME` never answers, `FAIL-ME` always gets a 500, anything
 * else takes one second. Times are measured from outside: each job's POST
 * (its enqueue) to its summary row, read by polling Postgres.
 */
import assert from "node:assert/strict";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { createProviderFlow, providerStateKey } from "../../src/provider/flow_control.ts";
import { listDeadLetters } from "../../src/queue/dead_letter.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createSummaryWorker } from "../../src/runs/worker.ts";
import { createDeployment } from "../../src/provider/deployment.ts";
import { enqueueToLane } from "../support/enqueue.ts";
import { errorBody, type ModelBehaviour, startFakeModel } from "../support/fake_model_server.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

Deno.test("isolation: a poison document or a bad key", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  let run = 0;

  /**
   * A worker at concurrency 40 with the settings (LLM_CALL_TIMEOUT_S=2, LLM_MAX_ATTEMPTS=2,
   * MAX_DELIVERIES=3), CLAIM_IDLE_MS=1500 so that redeliveries show within the test.
   */
  function setup(respond: (prompt: string) => ModelBehaviour, cooldownMs = 2_000) {
    const keys = serviceKeys(`${r.prefix}:run${run++}`);
    const model = startFakeModel((_, prompt) => respond(prompt));
    const flow = createProviderFlow({ redis: r.redis, log: silentLogger }, {
      key: providerStateKey(keys.prefix, { baseURL: model.url, model: "m", apiKey: "sk-test" }),
      rpm: 6_000,
      cooldownMs,
      probeLeaseMs: 4_000,
    });
    const worker = createSummaryWorker({
      redis: r.redis,
      sql: db.sql,
      models: createDeployment({
        llm: createOpenAiLlm({ apiKey: "sk-test", model: "m", baseURL: model.url }),
        flow,
        model: "m",
      }),
      log: silentLogger,
    }, {
      keys,
      consumer: `w${run}`,
      claimIdleMs: 1_500,
      maxDeliveries: 3,
      concurrency: 40,
      blockMs: 50,
      job: { budgetMs: 10_000, perCallTimeoutMs: 2_000, maxAttempts: 2, backoffBaseMs: 100, backoffCapMs: 500 },
    });
    const stop = new AbortController();
    const running = worker.run(stop.signal);
    const posted = new Map<string, number>();
    const post = async (tenant: string, text: string) => {
      const jobId = crypto.randomUUID();
      posted.set(jobId, Date.now());
      await enqueueToLane(r.redis, keys, { jobId, tenant, request: { text, notify: "ops@example.com" } });
      return jobId;
    };
    /** Milliseconds from each job's POST to its summary row; absent while not done. */
    const latencies = async (ids: string[]) => {
      const rows = await db.sql<{ job_id: string; at: Date }[]>`
        SELECT job_id::text, created_at AS at FROM summaries WHERE job_id = ANY(${ids}::uuid[])`;
      return new Map(rows.map((row) => [row.job_id, row.at.getTime() - posted.get(row.job_id)!]));
    };
    const dead = async () => (await listDeadLetters(r.redis, keys.lane("bad"))).map((d) => d.fields.job_id!);
    const callsOf = (marker: string) => model.prompts.filter((p) => p.includes(marker)).length;
    return {
      model,
      post,
      latencies,
      dead,
      callsOf,
      async close() {
        stop.abort();
        await running;
        await worker.close();
        await model.close();
      },
    };
  }

  const healthy = (i: number) => `Revenue rose ${i}% in Q3. Costs fell. The board approved the plan.`;

  try {
    for (const poison of ["HANG-ME", "FAIL-ME"] as const) {
      await t.step(
        `two ${poison} documents beside 36 healthy one-second jobs: each healthy job within 5 s, both dead-lettered`,
        async () => {
          const env = setup((prompt) =>
            prompt.includes("HANG-ME")
              ? { kind: "hang" }
              : prompt.includes("FAIL-ME")
              ? { kind: "status", status: 500, body: errorBody("The server had an error", "server_error") }
              : { kind: "ok", delayMs: 1_000 }
          );
          try {
            const bad = [await env.post("bad", `${poison}-1 first.`), await env.post("bad", `${poison}-2 second.`)];
            // Another tenant's steady traffic: three one-second jobs a second for 12 s.
            const good: string[] = [];
            for (let i = 0; i < 36; i++) {
              good.push(await env.post("good", healthy(i)));
              await sleep(333);
            }
            await waitFor("every healthy job done", async () => (await env.latencies(good)).size === 36, 15_000);
            const slowest = Math.max(...(await env.latencies(good)).values());
            assert.ok(slowest <= 5_000, `the slowest healthy job took ${slowest} ms from its POST`);
            await waitFor("both poison documents dead-lettered", async () => (await env.dead()).length === 2, 40_000);
            assert.deepEqual((await env.dead()).sort(), [...bad].sort());
            for (const marker of [`${poison}-1`, `${poison}-2`]) {
              const calls = env.callsOf(marker);
              assert.ok(calls <= 6, `${marker}: ${calls} model calls (MAX_DELIVERIES × LLM_MAX_ATTEMPTS = 6)`);
            }
            const [reason] = await db.sql<{ error: string }[]>`
              SELECT error FROM job_outcomes WHERE job_id = ${bad[0]!}::uuid`;
            assert.match(
              reason!.error,
              /^exceeded 3 deliveries: \d+ model calls? failed .*while the provider served other jobs/,
            );
          } finally {
            await env.close();
          }
        },
      );
    }

    await t.step("after a hanging document, 40 one-second jobs finish within 8 s", async () => {
      const env = setup((prompt) => prompt.includes("HANG-ME") ? { kind: "hang" } : { kind: "ok", delayMs: 1_000 });
      try {
        await env.post("bad", "HANG-ME-3 alone.");
        // Its first call has timed out, so the provider has seen one failure.
        await waitFor("the poison call timed out", () => env.callsOf("HANG-ME-3") >= 2, 10_000);
        const started = Date.now();
        const jobs: string[] = [];
        for (let i = 0; i < 40; i++) jobs.push(await env.post("good", healthy(i)));
        await waitFor("40 jobs done", async () => (await env.latencies(jobs)).size === 40, 15_000);
        const took = Math.max(...(await env.latencies(jobs)).values());
        assert.ok(took <= 8_000, `40 jobs took ${took} ms (posted in ${Date.now() - started} ms)`);
      } finally {
        await env.close();
      }
    });

    await t.step(
      "a provider answering 401 for 30 s: no job dead-lettered, calls bounded, all done within 10 s after",
      async () => {
        let unauthorized = true;
        let refused = 0;
        const env = setup(() => {
          if (!unauthorized) return { kind: "ok", delayMs: 200 };
          refused++;
          return {
            kind: "status",
            status: 401,
            body: errorBody("Incorrect API key provided: sk-test.", "invalid_request_error", "invalid_api_key"),
          };
        });
        try {
          const jobs: string[] = [];
          for (let i = 0; i < 20; i++) jobs.push(await env.post("good", healthy(i)));
          await sleep(30_000);
          const during = refused;
          unauthorized = false;
          const fixedAt = Date.now();
          await waitFor("every job done", async () => (await env.latencies(jobs)).size === 20, 12_000);
          const after = Date.now() - fixedAt;
          assert.ok(after <= 10_000, `done ${after} ms after the key works again`);
          assert.equal(
            (await listDeadLetters(r.redis, serviceKeys(`${r.prefix}:run${run - 1}`).lane("good"))).length,
            0,
          );
          // The calls under way when the first 401 lands (paced at 100/s), the one that opens the breaker, then
          // probes after 1 s and then one per cooldown (2 s): about 20 in 30 s.
          assert.ok(during <= 26, `${during} calls during the 30 s of 401s`);
        } finally {
          await env.close();
        }
      },
    );
  } finally {
    await r.close();
    await db.close();
  }
});
