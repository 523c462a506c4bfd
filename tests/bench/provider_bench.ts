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
import { enqueueToLane } from "../support/enqueue.ts";
import { KEY_PREFIX, serviceKeys } from "../../src/runs/keys.ts";
import { startWorkerProcess } from "./worker_process.ts";
import { limitedProvider, type Outage, startFakeModel } from "../support/fake_model_server.ts";
import { createScratchDatabase, emptyRedisDatabase, releaseRedisDatabase } from "../support/scratch.ts";

// The service's own key names: the processes run on an empty Redis database of their own.
const KEYS = serviceKeys(KEY_PREFIX);

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
    workers.push(await startWorkerProcess(env), await startWorkerProcess(env));
    if (outage) provider.setOutage(outage);
    const started = performance.now();
    await Promise.all(Array.from({ length: jobs }, (_, i) =>
      enqueueToLane(redis, KEYS, {
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
      dead: await redis.xlen(KEYS.lane("bench").dead),
      afterRecovery: (finished - recoveredAt) / 1000,
    };
  } finally {
    for (const w of workers) await w.stop();
    await model.close();
    await redis.quit();
    await releaseRedisDatabase(url).catch(() => {});
    await db.close();
  }
}
