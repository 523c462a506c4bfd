/**
 * Goodput under a provider limit: two real `worker` processes (the
 * permission set their task derives, the real `openai` SDK over HTTP)
 * against a local provider that allows `rps` requests in any sliding second
 * and answers 429 with OpenAI's headers above it. Also the two outages of
 * the flow-control issue: `insufficient_quota`, then 503, for a while from
 * the start, with a short breaker cooldown.
 */
import { Redis } from "ioredis";
import { sleep } from "../../src/async/timeout.ts";
import { parseConfig } from "../../src/config.ts";
import { permissionFlags } from "../../src/permissions.ts";
import { enqueueJob } from "../../src/summaries/enqueue.ts";
import { jobKeys } from "../../src/summaries/keys.ts";
import { limitedProvider, type Outage, startFakeModel } from "../support/fake_model_server.ts";
import { createScratchDatabase, emptyRedisDatabase } from "../support/scratch.ts";

const MAIN = decodeURIComponent(new URL("../../main.ts", import.meta.url).pathname);
const MIGRATIONS = decodeURIComponent(new URL("../../migrations/", import.meta.url).pathname);
// The service's own key names: the processes run on an empty Redis database of their own.
const KEYS = jobKeys("oncely");

/** What one run measured. */
export interface ProviderRun {
  jobs: number;
  seconds: number;
  calls: number;
  ok: number;
  rateLimited: number;
  failedDuringOutage: number;
  dead: number;
  /** Seconds from the provider's recovery until every job was done. */
  afterRecovery: number;
}

async function startWorker(env: Record<string, string>): Promise<{ stop(): Promise<void> }> {
  const child = new Deno.Command(Deno.execPath(), {
    args: ["run", ...permissionFlags("worker", parseConfig(env), MIGRATIONS), MAIN, "worker"],
    env: { ...env, NO_COLOR: "1" },
    stdout: "null",
    stderr: "piped",
  }).spawn();
  const lines = child.stderr.pipeThrough(new TextDecoderStream()).getReader();
  let buffered = "";
  const end = performance.now() + 30_000;
  while (!buffered.includes('"worker_started"')) {
    const { value, done } = await lines.read();
    if (done || performance.now() > end) throw new Error(`worker did not start: ${buffered.slice(-500)}`);
    buffered += value;
  }
  // Keep reading, or a full pipe would stall the worker.
  const drained = (async () => {
    while (!(await lines.read()).done) { /* discard */ }
  })().catch(() => {});
  return {
    async stop() {
      child.kill("SIGTERM");
      await child.status;
      await drained;
    },
  };
}

/**
 * Drains `jobs` jobs through two worker processes against a provider limited
 * to `rps`. With `outage`, the provider answers it from before the first job
 * until `outageMs` have passed.
 */
export async function providerRun(
  { jobs, rps, rpm, outage = null, outageMs = 0, cooldownS = 30, adminUrl, redisUrl }: {
    jobs: number;
    rps: number;
    rpm?: number;
    outage?: Outage;
    outageMs?: number;
    cooldownS?: number;
    adminUrl: string;
    redisUrl: string;
  },
): Promise<ProviderRun> {
  const db = await createScratchDatabase(adminUrl, { prefix: "oncely_bench" });
  const url = await emptyRedisDatabase(redisUrl);
  const redis = new Redis(url, { maxRetriesPerRequest: 1 });
  const provider = limitedProvider({ rps });
  const model = startFakeModel(provider.respond);
  const env: Record<string, string> = {
    DATABASE_URL: db.url,
    REDIS_URL: url,
    OPENAI_API_KEY: "sk-bench",
    OPENAI_BASE_URL: model.url,
    WORKER_CONCURRENCY: "32",
    LLM_BREAKER_COOLDOWN_S: String(cooldownS),
    LOG_LEVEL: "info",
    // Empty counts as unset, whatever the calling shell exports.
    LLM_RPM: rpm === undefined ? "" : String(rpm),
    LLM_TPM: "",
  };
  const workers: { stop(): Promise<void> }[] = [];
  try {
    workers.push(await startWorker(env), await startWorker(env));
    if (outage) provider.setOutage(outage);
    const started = performance.now();
    await Promise.all(Array.from({ length: jobs }, (_, i) =>
      enqueueJob(redis, KEYS, {
        jobId: crypto.randomUUID(),
        tenant: "bench",
        request: {
          text: `Revenue rose ${i}% in the quarter. Costs fell. The board approved the plan.`,
          notify: "o@x.co",
        },
      })));
    let failedDuringOutage = 0;
    let recoveredAt = started;
    if (outage) {
      await sleep(Math.max(0, started + outageMs - performance.now()));
      failedDuringOutage = provider.counts.quota + provider.counts.unavailable;
      provider.setOutage(null);
      recoveredAt = performance.now();
    }
    const deadline = performance.now() + 180_000;
    for (;;) {
      const [row] = await db.sql<{ n: number }[]>`SELECT count(*)::int AS n FROM summaries`;
      if (row!.n >= jobs) break;
      if (performance.now() > deadline) throw new Error(`provider bench: ${row!.n}/${jobs} done in 180 s`);
      await sleep(25);
    }
    const finished = performance.now();
    return {
      jobs,
      seconds: (finished - started) / 1000,
      calls: model.requests,
      ok: provider.counts.ok,
      rateLimited: provider.counts.rateLimited,
      failedDuringOutage,
      dead: await redis.xlen(KEYS.dead),
      afterRecovery: (finished - recoveredAt) / 1000,
    };
  } finally {
    for (const w of workers) await w.stop();
    await model.close();
    await redis.flushdb().catch(() => {});
    await redis.quit();
    await db.close();
  }
}
