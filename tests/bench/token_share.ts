/**
 * The provider's tokens shared between tenants: one real `worker` process
 * (its derived permission set, the real `openai` SDK over HTTP, limits
 * learned from the provider's headers) against a local provider that allows
 * `tpm` tokens per minute and answers 429 above it. Tenant A queues large
 * documents, then tenant B queues small ones; how long B waits, from its
 * enqueue until polling the database finds all of B's summaries.
 */
import { Redis } from "ioredis";
import { sleep } from "../../src/async/timeout.ts";
import { enqueueToLane } from "../support/enqueue.ts";
import { KEY_PREFIX, serviceKeys } from "../../src/runs/keys.ts";
import { startWorkerProcess } from "./worker_process.ts";
import { startFakeModel } from "../support/fake_model_server.ts";
import { createScratchDatabase, emptyRedisDatabase, releaseRedisDatabase } from "../support/scratch.ts";
import { documentOf, tokenLimitedProvider } from "../provider/token_limited_provider.ts";

// The service's own key names: the process runs on an empty Redis database of its own.
const KEYS = serviceKeys(KEY_PREFIX);

/** What one run measured. */
export interface TokenShareRun {
  /** Seconds from B's enqueue until every one of B's jobs was done. */
  seconds: number;
  /** A's jobs done by then. */
  aDone: number;
  calls: number;
  rateLimited: number;
}

/** A's `heavy.jobs` documents of `heavy.tokens`, then B's `light.jobs` of `light.tokens`, under `tpm`. */
export async function tokenShareRun(
  { tpm, heavy, light, adminUrl, redisUrl }: {
    tpm: number;
    heavy: { jobs: number; tokens: number };
    light: { jobs: number; tokens: number };
    adminUrl: string;
    redisUrl: string;
  },
): Promise<TokenShareRun> {
  const db = await createScratchDatabase(adminUrl, { prefix: "oncely_bench" });
  const url = await emptyRedisDatabase(redisUrl);
  const redis = new Redis(url, { maxRetriesPerRequest: 1 });
  const provider = tokenLimitedProvider({ tpm });
  const model = startFakeModel(provider.respond);
  const env: Record<string, string> = {
    DATABASE_URL: db.url,
    REDIS_URL: url,
    OPENAI_API_KEY: "sk-bench",
    OPENAI_BASE_URL: model.url,
    WORKER_CONCURRENCY: "32",
    LOG_LEVEL: "info",
    // Empty counts as unset, whatever the calling shell exports: the limits come from the headers.
    LLM_RPM: "",
    LLM_TPM: "",
  };
  const worker = await startWorkerProcess(env);
  try {
    const enqueue = async (tenant: string, text: string) => {
      const jobId = crypto.randomUUID();
      await enqueueToLane(redis, KEYS, { jobId, tenant, request: { text, notify: "o@x.co" } });
      return jobId;
    };
    for (let i = 0; i < heavy.jobs; i++) await enqueue("a", documentOf(heavy.tokens, `A${i}`));
    const posted = performance.now();
    const ids = await Promise.all(
      Array.from({ length: light.jobs }, (_, i) => enqueue("b", documentOf(light.tokens, `B${i}`))),
    );
    const deadline = posted + 300_000;
    for (;;) {
      const [row] = await db.sql<{ n: number }[]>`SELECT count(*)::int AS n FROM summaries WHERE job_id = ANY(${ids})`;
      if (row!.n === ids.length) break;
      if (performance.now() > deadline) throw new Error(`token share: ${row!.n}/${ids.length} of B done in 300 s`);
      await sleep(25);
    }
    const seconds = (performance.now() - posted) / 1000;
    const [a] = await db.sql<{ n: number }[]>`SELECT count(*)::int AS n FROM summaries WHERE tenant = 'a'`;
    return { seconds, aDone: a!.n, calls: model.requests, rateLimited: provider.counts.rateLimited };
  } finally {
    await worker.stop();
    await model.close();
    await redis.quit();
    await releaseRedisDatabase(url).catch(() => {});
    await db.close();
  }
}
