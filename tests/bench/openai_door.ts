/**
 * The OpenAI-compatible door's cost per call (issue 42): the real `openai` SDK over HTTP, one call at a time,
 * through the API handler on a loopback port (intake, lane, worker, model call, commit, the wait's wake-up)
 * against the same call straight to the fake model. The difference of the p50s is what the door adds.
 */
import OpenAI from "openai";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createJobWaiter } from "../../src/runs/job_waiter.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { AUTH_DEFAULTS } from "../../src/tenants/authenticator.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { startFakeModel } from "../support/fake_model_server.ts";
import { apiHandler, summaryWorker } from "../support/fixtures.ts";
import { createScratchDatabase, createScratchRedis } from "../support/scratch.ts";
import { fmt, quantile } from "./stats.ts";
import type { HostileRow } from "./hostile.ts";

/** p50s of `calls` sequential chat completions, direct and through the door, as one bench row. */
export async function benchOpenAiDoor(
  { adminUrl, redisUrl, smoke, progress }: {
    adminUrl: string;
    redisUrl: string;
    smoke: boolean;
    progress: (msg: string) => void;
  },
): Promise<HostileRow[]> {
  const calls = smoke ? 10 : 300;
  const db = await createScratchDatabase(adminUrl);
  const r = await createScratchRedis(redisUrl);
  const keys = serviceKeys(r.prefix);
  const model = startFakeModel();
  const waiter = await createJobWaiter({ sql: db.sql, log: silentLogger });
  // Keys cached as the API process caches them (the fixture's default of 0 looks the key up on every request).
  const handler = apiHandler({ redis: r.redis, sql: db.sql, keys }, {
    authMode: "api-key",
    waiter,
    authCacheTtlMs: AUTH_DEFAULTS.cacheTtlMs,
  });
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen() {} }, (req) => handler(req));
  const llm = createOpenAiLlm({ apiKey: "sk-bench", model: "fake-model", baseURL: model.url });
  const worker = summaryWorker({ redis: r.redis, sql: db.sql, llm, keys }, { job: { model: "fake-model" } });
  const stop = new AbortController();
  const running = worker.run(stop.signal);
  try {
    const key = await createApiKey(db.sql, "bench");
    const door = new OpenAI({ apiKey: key, baseURL: `http://127.0.0.1:${server.addr.port}/v1`, maxRetries: 0 });
    const direct = new OpenAI({ apiKey: "sk-bench", baseURL: model.url, maxRetries: 0 });
    const time = async (client: OpenAI, i: number, keyed: boolean) => {
      const start = performance.now();
      await client.chat.completions.create(
        { model: "fake-model", messages: [{ role: "user", content: `Bench call ${i}: revenue rose 12% in Q3.` }] },
        keyed ? { headers: { "Idempotency-Key": `bench-door-${String(i).padStart(8, "0")}` } } : {},
      );
      return performance.now() - start;
    };
    // Warm both paths (JIT, connections, the task cache), then alternate so drift hits both alike.
    for (let i = 0; i < 10; i++) await time(door, -1 - i, false), await time(direct, i, false);
    const viaDoor: number[] = [];
    const straight: number[] = [];
    for (let i = 0; i < calls; i++) {
      straight.push(await time(direct, i, false));
      viaDoor.push(await time(door, i, true));
    }
    const p50 = quantile(viaDoor, 0.5);
    const base = quantile(straight, 0.5);
    progress(`openai door: p50 ${fmt(p50, 1)} ms through the door, ${fmt(base, 1)} ms direct (${calls} calls each)`);
    return [{
      benchmark: `openai door: chat completion through the SDK, ${calls} sequential calls, p50 (p99)`,
      result: `${fmt(p50, 1)} ms (${fmt(quantile(viaDoor, 0.99), 1)} ms)`,
      baseline: `${fmt(base, 1)} ms (${fmt(quantile(straight, 0.99), 1)} ms) straight to the fake model`,
      ratio: `+${fmt(p50 - base, 1)} ms`,
      goal: "the door adds at most 5 ms to a call's p50 against calling the fake model directly",
      value: p50,
      baselineValue: base,
    }];
  } finally {
    stop.abort();
    await running;
    // Its lane source's subscriber and its validators keep the bench's process alive until closed.
    await worker.close();
    await server.shutdown();
    await waiter.close();
    await model.close();
    await r.close();
    await db.close();
  }
}
