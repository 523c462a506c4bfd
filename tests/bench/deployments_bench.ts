/**
 * Issue 40's rows: several deployments (`LLM_DEPLOYMENTS`) under load. Two real `worker` processes (`main.ts
 * worker` with the permission set its task derives, the real `openai` SDK over HTTP) configured with
 * `LLM_DEPLOYMENTS` naming local model servers, each enforcing its own limit (requests in any sliding second) with
 * OpenAI's `x-ratelimit-*` headers and `429 rate_limit_exceeded` bodies, their keys in `LLM_KEY_*` variables and
 * their limits learned from the headers. The backlog is queued with the tests' enqueue script without a wake-up;
 * the clock starts when the lane is announced and stops when every run is decided.
 */
import { Redis } from "ioredis";
import { sleep } from "../../src/async/timeout.ts";
import { announceLane } from "../../src/queue/lanes.ts";
import { putTaskVersion } from "../../src/jobs/task_store.ts";
import { KEY_PREFIX, serviceKeys } from "../../src/runs/keys.ts";
import { enqueueJob, enqueueRunToLane } from "../support/enqueue.ts";
import { type LimitedProvider, limitedProvider, startFakeModel } from "../support/fake_model_server.ts";
import { createScratchDatabase, emptyRedisDatabase, releaseRedisDatabase } from "../support/scratch.ts";
import { startWorkerProcess } from "./worker_process.ts";
import { storedDefinition, TRIAGE_BODIES, triageInput } from "./triage_task.ts";

// The service's own key names: the processes run on an empty Redis database of their own.
const KEYS = serviceKeys(KEY_PREFIX);
const TENANT = "bench";
const WORKERS = 2;
const CONCURRENCY = 32;

/** One deployment of a run: its own model server, limited to `rps` requests in any sliding second. */
export interface BenchDeployment {
  name: string;
  models: string[];
  weight: number;
  rps: number;
  /** Its `rpm` in `LLM_DEPLOYMENTS`; unset, learned from its headers. */
  rpm?: number;
}

/** What one server saw. */
export interface ServerCounts {
  calls: number;
  ok: number;
  rateLimited: number;
  /** The most requests that arrived (answered or refused) in any sliding second. */
  maxPerSecond: number;
  /** When each 429 was answered, in ms from the server's first request. */
  limitedAtMs: number[];
  /**
   * The shortest time spanned by limit + 1 arrivals in a row (ms): under 1,000, the provider saw more than its
   * limit in a sliding second; its distance above 1,000 is the headroom the pacing left.
   */
  tightestMs: number;
}

/** What one run measured. */
export interface DeploymentsRun {
  jobs: number;
  seconds: number;
  /** By deployment name. */
  servers: Record<string, ServerCounts>;
  /** Each run's successful attempt, by deployment (`model_attempts.deployment`). */
  served: Record<string, number>;
  dead: number;
}

/** The most of `times` (ms, ascending) within any window of `windowMs`. */
export function maxInWindow(times: readonly number[], windowMs = 1_000): number {
  let most = 0;
  for (let first = 0, last = 0; last < times.length; last++) {
    while (times[last]! - times[first]! >= windowMs) first++;
    most = Math.max(most, last - first + 1);
  }
  return most;
}

/**
 * Drains `jobs` runs through two worker processes over `deployments`: summaries of the default model, or with
 * `fallbackTask`, runs of a task listing those models in order. `pause`: `deployment` answers `429
 * rate_limit_exceeded` to everything for `ms`, from `atMs` after the clock starts.
 */
export async function deploymentsRun(
  { deployments, jobs, fallbackTask, pause, adminUrl, redisUrl }: {
    deployments: BenchDeployment[];
    jobs: number;
    fallbackTask?: string[];
    pause?: { deployment: string; atMs: number; ms: number };
    adminUrl: string;
    redisUrl: string;
  },
): Promise<DeploymentsRun> {
  const db = await createScratchDatabase(adminUrl, { prefix: "oncely_bench" });
  const url = await emptyRedisDatabase(redisUrl);
  const redis = new Redis(url, { maxRetriesPerRequest: 1 });
  const servers = deployments.map((d) => {
    const provider = limitedProvider({ rps: d.rps });
    const arrived: number[] = [];
    const limitedAt: number[] = [];
    const model = startFakeModel((n, prompt) => {
      const now = performance.now();
      arrived.push(now);
      const answer = provider.respond(n, prompt);
      if (answer.kind === "status" && answer.status === 429) limitedAt.push(now);
      return answer;
    });
    return { ...d, provider, arrived, limitedAt, model, keyEnv: `LLM_KEY_BENCH_${d.name.toUpperCase()}` };
  });
  const env: Record<string, string> = {
    DATABASE_URL: db.url,
    REDIS_URL: url,
    LLM_DEPLOYMENTS: JSON.stringify(servers.map((s) => ({
      name: s.name,
      base_url: s.model.url,
      api_key_env: s.keyEnv,
      models: s.models,
      weight: s.weight,
      ...(s.rpm === undefined ? {} : { rpm: s.rpm }),
    }))),
    ...Object.fromEntries(servers.map((s) => [s.keyEnv, `sk-bench-${s.name}`])),
    WORKER_CONCURRENCY: String(CONCURRENCY),
    LOG_LEVEL: "info",
    // Empty counts as unset, whatever the calling shell exports: LLM_DEPLOYMENTS refuses LLM_RPM and LLM_TPM.
    OPENAI_API_KEY: "",
    OPENAI_BASE_URL: "",
    LLM_RPM: "",
    LLM_TPM: "",
    LLM_FALLBACK_AFTER_S: "",
  };
  const workers: { stop(): Promise<void> }[] = [];
  try {
    for (let i = 0; i < WORKERS; i++) workers.push(await startWorkerProcess(env));
    if (fallbackTask) {
      const body = { ...TRIAGE_BODIES.text, model: fallbackTask };
      await putTaskVersion(db.sql, TENANT, "triage", storedDefinition(body));
    }
    await Promise.all(Array.from({ length: jobs }, (_, i) => {
      const jobId = crypto.randomUUID();
      return fallbackTask
        ? enqueueRunToLane(redis, KEYS, {
          jobId,
          tenant: TENANT,
          run: { task: "triage", version: 1, input: triageInput(i) },
        }, { announce: false })
        : enqueueJob(redis, KEYS.lane(TENANT), {
          jobId,
          tenant: TENANT,
          request: {
            text: `Revenue rose ${i}% in the quarter. Costs fell. The board approved the plan.`,
            notify: "o@x.co",
          },
        });
    }));
    const started = performance.now();
    await announceLane(redis, KEYS.registry, TENANT);
    const paused = pause &&
      sleep(pause.atMs).then(() => servers.find((s) => s.name === pause.deployment)!.provider.pauseFor(pause.ms));
    const dead = () => redis.xlen(KEYS.lane(TENANT).dead);
    const deadline = started + 180_000;
    for (;;) {
      const [row] = await db.sql<{ n: number }[]>`SELECT count(*)::int AS n FROM job_outcomes`;
      if (row!.n + await dead() >= jobs) break;
      if (performance.now() > deadline) throw new Error(`deployments bench: ${row!.n}/${jobs} done in 180 s`);
      await sleep(25);
    }
    const seconds = (performance.now() - started) / 1000;
    await paused;
    const deadCount = await dead();
    // Attempts are recorded in the background, in batches: each finished run's successful one, once there.
    let served: { deployment: string; n: number }[] = [];
    for (const end = performance.now() + 10_000; performance.now() < end; await sleep(50)) {
      served = await db.sql<{ deployment: string; n: number }[]>`
        SELECT deployment, count(*)::int AS n FROM model_attempts WHERE outcome = 'ok' GROUP BY 1`;
      if (served.reduce((sum, s) => sum + s.n, 0) >= jobs - deadCount) break;
    }
    return {
      jobs,
      seconds,
      servers: Object.fromEntries(servers.map((s) => [s.name, countsOf(s.provider, s.arrived, s.limitedAt, s.rps)])),
      served: Object.fromEntries(served.map((s) => [s.deployment, s.n])),
      dead: deadCount,
    };
  } finally {
    for (const w of workers) await w.stop();
    for (const s of servers) await s.model.close();
    await redis.quit();
    await releaseRedisDatabase(url).catch(() => {});
    await db.close();
  }
}

function countsOf(provider: LimitedProvider, arrived: number[], limitedAt: number[], rps: number): ServerCounts {
  const { ok, rateLimited } = provider.counts;
  const first = arrived[0] ?? 0;
  let tightest = Infinity;
  for (let i = rps; i < arrived.length; i++) tightest = Math.min(tightest, arrived[i]! - arrived[i - rps]!);
  return {
    calls: arrived.length,
    ok,
    rateLimited,
    maxPerSecond: maxInWindow(arrived),
    limitedAtMs: limitedAt.map((at) => Math.round(at - first)),
    tightestMs: Math.round(tightest),
  };
}
