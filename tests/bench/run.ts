/**
 * `deno task bench`: measures the pipeline against baselines run the same way
 * on the same machine in the same run, and prints one Markdown table of
 * medians and ratios. `--smoke` runs each part briefly (CI checks that the
 * bench runs, not the numbers); `--json FILE` also writes the rows as JSON.
 * Every server it starts listens on 127.0.0.1 and every loop is bounded.
 */
import type { Sql } from "postgres";
import { settlesWithin, sleep } from "../../src/async/timeout.ts";
import { createLogger, silentLogger } from "../../src/log/logger.ts";
import type { LLM } from "../../src/llm/llm.ts";
import { createResendMailer } from "../../src/mail/resend_mailer.ts";
import { commitResults } from "../../src/runs/commit.ts";
import { KEY_PREFIX, type ServiceKeys, serviceKeys } from "../../src/runs/keys.ts";
import { createSummaryWorker } from "../../src/runs/worker.ts";
import { createDeployment } from "../../src/provider/deployment.ts";
import { createStreamWorker, type StreamWorker } from "../../src/queue/stream_worker.ts";
import { staticLanes } from "../../src/queue/static_lanes.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { startFakeMail } from "../support/fake_mail_server.ts";
import {
  createScratchDatabase,
  createScratchRedis,
  emptyRedisDatabase,
  releaseRedisDatabase,
  type ScratchRedis,
} from "../support/scratch.ts";
import { type HttpLoad, postLoad } from "./wrk.ts";
import { VARIANTS } from "./ingest_variants.ts";
import { apiHandler, relayTo, summaryWorker } from "../support/fixtures.ts";
import { SUMMARY_READY_KEY_PREFIX } from "../../src/runs/shapes.ts";
import { cpuMs, sdkCeiling, startModelProcess, startServiceProcess, startWorkerProcess } from "./worker_process.ts";
import { startApi } from "./api_server.ts";
import { completionBody } from "../support/fake_model_server.ts";
import { Redis } from "ioredis";
import { enqueueJob, enqueueRunToLane, enqueueToLane } from "../support/enqueue.ts";
import { freePort } from "../support/free_port.ts";
import { type ProviderRun, providerRun } from "./provider_bench.ts";
import { type BenchDeployment, type DeploymentsRun, deploymentsRun } from "./deployments_bench.ts";
import { type TokenShareRun, tokenShareRun } from "./token_share.ts";
import { fmt, median, quantile } from "./stats.ts";
import { RUN_BODY, storedDefinition, TRIAGE_BODIES, triageInput } from "./triage_task.ts";
import { putTaskVersion } from "../../src/jobs/task_store.ts";
import { setTenantBudget } from "../../src/tenants/tenant_budgets.ts";
import type { Limits } from "../../src/budgets/budget_hash.ts";
import { readBudgetState } from "../../src/budgets/read_script.ts";
import { runReserve } from "../../src/budgets/reserve_script.ts";
import { runSettle } from "../../src/budgets/settle_script.ts";
import { seedBudgetState } from "../../src/budgets/seed_script.ts";
import { announceLane } from "../../src/queue/lanes.ts";
import { benchHostile, type HostileRow } from "./hostile.ts";
import { benchOpenAiDoor } from "./openai_door.ts";
import type { SummaryRequest } from "../../src/runs/shapes.ts";
import { createIntake } from "../../src/runs/intake.ts";
import { summaryForms } from "../../src/runs/run_payload.ts";
import { SUMMARIES } from "../../src/summaries/api.ts";

const ADMIN_URL = Deno.env.get("BENCH_DATABASE_URL") ?? "postgres://postgres@127.0.0.1:5432/postgres";
const REDIS_URL = Deno.env.get("BENCH_REDIS_URL") ?? "redis://127.0.0.1:6379/0";
const smoke = Deno.args.includes("--smoke");
const jsonAt = Deno.args.indexOf("--json");
const jsonFile = jsonAt >= 0 ? Deno.args[jsonAt + 1] ?? "bench-results.json" : undefined;
const only = Deno.args.find((a) => a.startsWith("--only="))?.slice("--only=".length).split(",");
const RUNS = smoke ? 1 : Number(Deno.env.get("BENCH_RUNS") ?? 3);
const progress = (msg: string) => console.error(`[bench] ${msg}`);

/** One line of the results table (the hostile section's rows have the same shape). */
type Row = HostileRow;
const rows: Row[] = [];

const BODY = JSON.stringify({
  text: "Revenue rose 12% in Q3. Costs fell. The board approved the expansion plan for next year.",
  notify: "ops@example.com",
});
const fixedLlm = (delayMs: number): LLM => ({
  complete: (_prompt, { signal }) =>
    delayMs > 0
      ? sleep(delayMs, signal).then(() => ({ text: "Revenue rose; costs fell." }))
      : Promise.resolve({ text: "Revenue rose." }),
});

async function countRows(
  sql: Sql,
  table: "summaries" | "outbox" | "run_results",
  sentOnly = false,
): Promise<number> {
  const [row] = sentOnly
    ? await sql<{ n: number }[]>`SELECT count(*)::int AS n FROM outbox WHERE sent_at IS NOT NULL`
    : await sql<{ n: number }[]>`SELECT count(*)::int AS n FROM ${sql(table)}`;
  return row!.n;
}

/** Queues `n` jobs of tenant `bench` in its lane, then announces the lane once. */
async function enqueueMany(r: ScratchRedis, n: number, keys: ServiceKeys) {
  const lane = keys.lane("bench");
  for (let start = 0; start < n; start += 1000) {
    const p = r.redis.pipeline();
    for (let i = start; i < Math.min(n, start + 1000); i++) {
      p.xadd(lane.stream, "*", "job_id", crypto.randomUUID(), "tenant", "bench", "payload", BODY);
    }
    await p.exec();
  }
  await announceLane(r.redis, keys.registry, "bench");
}

/** The load run whose rate is the median of `results` (its p50 and p99 go with it). */
function medianRun(results: HttpLoad[]): { rps: number; p50: number; p99: number } {
  const mid = results.find((x) => x.perSecond === median(results.map((y) => y.perSecond)))!;
  return { rps: mid.perSecond, p50: mid.p50, p99: mid.p99 };
}

/** How the intake rows name their load generator. */
function generatorLabel(generator: string): string {
  return generator === "wrk" ? "wrk" : "Deno fetch loop (wrk unavailable: the baseline is the generator's limit)";
}

async function startIngestServer(
  mode: string,
  port: number,
  dbUrl: string,
  prefix: string,
  script = "./ingest_server.ts",
) {
  const child = new Deno.Command(Deno.execPath(), {
    args: [
      "run",
      "--allow-net=127.0.0.1",
      "--allow-env",
      "--allow-read",
      "--allow-sys",
      // Its validation children (tasks/pool_channels.ts).
      `--allow-run=${Deno.execPath()}`,
      new URL(script, import.meta.url).pathname,
      mode,
      String(port),
      dbUrl,
      REDIS_URL,
      prefix,
    ],
    stdout: "piped",
    stderr: "null", // its JSON logs: written (the cost is measured), then discarded
  }).spawn();
  const reader = child.stdout.pipeThrough(new TextDecoderStream()).getReader();
  const { value } = await reader.read();
  if (!value?.includes("ready")) throw new Error(`ingest server (${mode}) did not start`);
  reader.releaseLock();
  return {
    pid: child.pid,
    async stop() {
      child.kill("SIGTERM");
      await child.status;
      await child.stdout.cancel().catch(() => {});
    },
  };
}

/** How the ingest rows' loads were taken, for their labels. */
const INGEST_LOAD = "64 connections, a unique Idempotency-Key per POST";

/**
 * Intake against both of its baselines, in one run: the real API (`deno task api`, one process), a bare
 * `Deno.serve` that parses the same JSON, and the design's floor (bare plus the one Redis script an accepted
 * POST must run); and the same API with `--parallel=2`. All servers run side by side, and each round loads
 * each of them in turn, the order rotating, so the machine's load moves them alike; medians of the rounds.
 */
async function benchIngest() {
  const db = await createScratchDatabase(ADMIN_URL, { prefix: "oncely_bench" });
  const r = await createScratchRedis(REDIS_URL, "oncely_bench");
  // The API processes use the service's fixed key names: a Redis database nobody else uses.
  const apiRedisUrl = await emptyRedisDatabase(REDIS_URL);
  const key = await createApiKey(db.sql, "bench");
  const seconds = smoke ? 1 : 5;
  const runId = crypto.randomUUID().slice(0, 8);
  type Server = { port: number; cpuMs(): Promise<number>; peakRssMiB?(): Promise<number>; stop(): Promise<void> };
  const servers: Record<string, Server> = {};
  const baseline = async (mode: "bare" | "floor") => {
    const port = freePort();
    const server = await startIngestServer(mode, port, db.url, r.prefix);
    return { port, cpuMs: () => cpuMs(server.pid), stop: server.stop };
  };
  const api = async (parallel?: number, root?: string) => {
    const port = freePort();
    const env = { DATABASE_URL: db.url, REDIS_URL: apiRedisUrl, PORT: String(port), LOG_LEVEL: "info" };
    const server = await startApi(env, { parallel, root });
    return { port, cpuMs: server.cpuMs, peakRssMiB: server.peakRssMiB, stop: server.stop };
  };
  // BENCH_INGEST_BEFORE=DIR: another checkout's API (an earlier commit, `git archive` into DIR) in the same rounds.
  const before = Deno.env.get("BENCH_INGEST_BEFORE");
  const load = async (name: string, seconds: number, tag: string, sameKey = false) => {
    const server = servers[name]!;
    const before = await server.cpuMs();
    const result = await postLoad({
      url: `http://127.0.0.1:${server.port}/v1/summaries`,
      headers: {
        authorization: `Bearer ${key}`,
        "content-type": "application/json",
        ...(sameKey ? { "idempotency-key": `bench-replay-${runId}` } : {}),
      },
      body: BODY,
      vary: sameKey ? undefined : { header: "idempotency-key", prefix: `bench-${name}-${runId}-${tag}-` },
      connections: 64,
      seconds,
      expectStatus: 202,
    }, progress);
    if (result.errors > 0) throw new Error(`ingest ${name}: ${result.errors} requests were not answered 202`);
    const cpuUs = ((await server.cpuMs()) - before) * 1000 / (result.perSecond * seconds);
    progress(`ingest: ${name}: ${fmt(result.perSecond)}/s, p99 ${fmt(result.p99, 1)} ms, ${fmt(cpuUs)} µs CPU/req`);
    return { ...result, cpuUs };
  };
  try {
    progress("ingest: starting bare, floor, api and api --parallel=2");
    servers.bare = await baseline("bare");
    servers.floor = await baseline("floor");
    servers.api = await api();
    servers.parallel = await api(2);
    if (before) servers.before = await api(undefined, before);
    const names = ["bare", "floor", "api", "parallel", ...(before ? ["before"] : [])];
    // Every path compiled by the JIT before any is measured.
    for (const name of names) await load(name, smoke ? 1 : 3, "warm");
    const results: Record<string, (HttpLoad & { cpuUs: number })[]> = {};
    for (let i = 0; i < RUNS; i++) {
      const order = [...names.slice(i % names.length), ...names.slice(0, i % names.length)];
      for (const name of order) {
        progress(`ingest: ${name}, unique keys, ${seconds} s (round ${i + 1})`);
        (results[name] ??= []).push(await load(name, seconds, String(i)));
      }
    }
    const replays: HttpLoad[] = [];
    for (let i = 0; i < RUNS; i++) replays.push(await load("api", seconds, `replay-${i}`, true));
    const m = Object.fromEntries(names.map((name) => [name, medianRun(results[name]!)]));
    const rss = async (name: string) => `peak RSS ${fmt(await servers[name]!.peakRssMiB!())} MiB`;
    const cpu = (name: string) => median(results[name]!.map((x) => x.cpuUs));
    const { bare, floor, api: one, parallel } = m as Record<string, ReturnType<typeof medianRun>>;
    const by = generatorLabel(results.api![0]!.generator);
    const latency = (x: ReturnType<typeof medianRun>) => `p50 ${fmt(x.p50, 1)} ms, p99 ${fmt(x.p99, 1)} ms`;
    const toBare = one!.rps / bare!.rps, toFloor = one!.rps / floor!.rps;
    rows.push({
      benchmark: `Ingest POST/s, real API (deno task api), one process, ${INGEST_LOAD}, ${by}`,
      result: `${fmt(one!.rps)}/s (${latency(one!)}); API CPU ${fmt(cpu("api"))} µs/request, ${await rss("api")}`,
      baseline: `bare Deno.serve ${fmt(bare!.rps)}/s (${latency(bare!)}); CPU ${fmt(cpu("bare"))} µs/request`,
      ratio: `${fmt(toBare, 2)}x`,
      goal: `>= 0.4x, p99 <= 25 ms ${toBare >= 0.4 && one!.p99 <= 25 ? "(met)" : "(NOT met)"}`,
      value: one!.rps,
      baselineValue: bare!.rps,
    });
    rows.push({
      benchmark: `Ingest POST/s, the same API process against the design's floor`,
      result: `${fmt(one!.rps)}/s`,
      baseline: `bare Deno.serve + the one Redis script (record + stream entry, ioredis) ${fmt(floor!.rps)}/s ` +
        `(${latency(floor!)}); CPU ${fmt(cpu("floor"))} µs/request`,
      ratio: `${fmt(toFloor, 2)}x`,
      goal: `>= 0.8x ${toFloor >= 0.8 ? "(met)" : "(NOT met)"}`,
      value: one!.rps,
      baselineValue: floor!.rps,
    });
    rows.push({
      benchmark: `Ingest POST/s, deno task api --parallel=2 (two API processes on one port), ${INGEST_LOAD}, ${by}; ` +
        `${navigator.hardwareConcurrency} cores shared with wrk (2 threads) and Redis`,
      result: `${fmt(parallel!.rps)}/s (${latency(parallel!)}); API CPU ${fmt(cpu("parallel"))} µs/request (both)`,
      baseline: `one process, same rounds: ${fmt(one!.rps)}/s; bare Deno.serve ${fmt(bare!.rps)}/s`,
      ratio: `${fmt(parallel!.rps / one!.rps, 2)}x one process; ${fmt(parallel!.rps / bare!.rps, 2)}x bare`,
      value: parallel!.rps,
      baselineValue: one!.rps,
    });
    if (before) {
      const earlier = m.before!;
      rows.push({
        benchmark: `Ingest POST/s, the API of ${before} (BENCH_INGEST_BEFORE), one process, in the same rounds`,
        result: `${fmt(earlier.rps)}/s (${latency(earlier)}); API CPU ${fmt(cpu("before"))} µs/request, ${await rss(
          "before",
        )}`,
        baseline: `this checkout's API ${fmt(one!.rps)}/s`,
        ratio: `${fmt(one!.rps / earlier.rps, 2)}x (this / that)`,
        value: earlier.rps,
        baselineValue: one!.rps,
      });
    }
    const replay = medianRun(replays);
    rows.push({
      benchmark: `Ingest POST/s, replay of one key, one API process, 64 connections, ${by}`,
      result: `${fmt(replay.rps)}/s (${latency(replay)})`,
      baseline: `bare Deno.serve ${fmt(bare!.rps)}/s`,
      ratio: `${fmt(replay.rps / bare!.rps, 2)}x`,
      value: replay.rps,
      baselineValue: bare!.rps,
    });
  } finally {
    for (const server of Object.values(servers)) await server.stop();
    await releaseRedisDatabase(apiRedisUrl).catch(() => {});
    await r.close();
    await db.close();
  }
}

/**
 * Run intake (`POST /v1/tasks/{name}/runs`: the task version through the cache, the input validated against
 * its schema) against summary intake, both with unique keys on one API server, the two loads alternating.
 */
async function benchIngestRuns() {
  const db = await createScratchDatabase(ADMIN_URL, { prefix: "oncely_bench" });
  const r = await createScratchRedis(REDIS_URL, "oncely_bench");
  const key = await createApiKey(db.sql, "bench");
  const seconds = smoke ? 1 : 5;
  const port = freePort();
  const server = await startIngestServer("api", port, db.url, r.prefix);
  const base = `http://127.0.0.1:${port}`;
  const headers = { authorization: `Bearer ${key}`, "content-type": "application/json" };
  const post = async (path: string, body: unknown, method = "POST", extra: Record<string, string> = {}) => {
    const res = await fetch(`${base}${path}`, {
      method,
      headers: { ...headers, ...extra },
      body: JSON.stringify(body),
    });
    return { status: res.status, text: await res.text() };
  };
  const paths = { summaries: ["/v1/summaries", BODY], runs: ["/v1/tasks/triage/runs", RUN_BODY] } as const;
  const runId = crypto.randomUUID().slice(0, 8);
  // The API process's CPU per accepted request as well: on a shared machine it moves less than the rate does.
  const load = async (which: keyof typeof paths, seconds: number, tag: string) => {
    const before = await cpuMs(server.pid);
    const result = await postLoad({
      url: `${base}${paths[which][0]}`,
      headers,
      body: paths[which][1],
      vary: { header: "idempotency-key", prefix: `bench-${which}-${runId}-${tag}-` },
      connections: 64,
      seconds,
      expectStatus: 202,
    }, progress);
    const cpuUs = ((await cpuMs(server.pid)) - before) * 1000 / (result.perSecond * seconds);
    progress(
      `ingest runs: ${which}: ${fmt(result.perSecond)}/s, p99 ${fmt(result.p99, 1)} ms, ${fmt(cpuUs)} µs CPU/req`,
    );
    return { ...result, cpuUs };
  };
  try {
    const put = await post("/v1/tasks/triage", TRIAGE_BODIES.text, "PUT");
    if (put.status !== 201) throw new Error(`ingest runs: PUT /v1/tasks/triage answered ${put.status}: ${put.text}`);
    // The input is validated on this path: a value outside the schema's enum is refused.
    const bad = await post("/v1/tasks/triage/runs", { input: { ticket: "x", product: "y", channel: "fax" } }, "POST", {
      "idempotency-key": `bench-bad-input-${runId}`,
    });
    if (bad.status !== 422 || !bad.text.includes("/input/channel")) {
      throw new Error(`ingest runs: an input outside the schema answered ${bad.status}: ${bad.text.slice(0, 300)}`);
    }
    if (!smoke) {
      // Both paths compiled by the JIT before either is measured: one second each left the first pair cold.
      progress("ingest runs: warm-up, 3 s of summaries then 3 s of runs");
      await load("summaries", 3, "warm");
      await load("runs", 3, "warm");
    }
    const results: Record<keyof typeof paths, (HttpLoad & { cpuUs: number })[]> = { summaries: [], runs: [] };
    for (let i = 0; i < RUNS; i++) {
      // Alternating which goes first, so neither always runs behind the other's backlog (Redis memory, GC).
      const order = i % 2 === 0 ? (["summaries", "runs"] as const) : (["runs", "summaries"] as const);
      for (const which of order) {
        progress(`ingest runs: POST ${paths[which][0]}, unique keys, ${seconds} s (run ${i + 1})`);
        results[which].push(await load(which, seconds, String(i)));
      }
    }
    for (const [which, list] of Object.entries(results)) {
      const errors = list.reduce((n, x) => n + x.errors, 0);
      if (errors > 0) throw new Error(`ingest runs: ${errors} POSTs to ${which} were not answered 202`);
    }
    const summaries = medianRun(results.summaries), runs = medianRun(results.runs);
    const ratio = runs.rps / summaries.rps;
    const cpu = (which: keyof typeof paths) => median(results[which].map((x) => x.cpuUs));
    rows.push({
      benchmark: `Run intake POST /v1/tasks/{name}/runs per s, input schema of 3 properties, unique keys, ` +
        `64 connections, ${generatorLabel(results.runs[0]!.generator)}`,
      result: `${fmt(runs.rps)}/s (p50 ${fmt(runs.p50, 1)} ms, p99 ${fmt(runs.p99, 1)} ms); ` +
        `API CPU ${fmt(cpu("runs"))} µs/request`,
      baseline: `summary intake POST /v1/summaries, same API process, alternating: ${fmt(summaries.rps)}/s ` +
        `(p50 ${fmt(summaries.p50, 1)} ms, p99 ${fmt(summaries.p99, 1)} ms); API CPU ${
          fmt(cpu("summaries"))
        } µs/request`,
      ratio: `${fmt(ratio, 2)}x`,
      goal: `>= 0.9x ${ratio >= 0.9 ? "(met)" : "(NOT met)"}`,
      value: runs.rps,
      baselineValue: summaries.rps,
    });
  } finally {
    await server.stop();
    await r.close();
    await db.close();
  }
}

/** Each step of the API's POST path under the same wrk load, to show where its time goes. */
async function benchIngestProfile() {
  const db = await createScratchDatabase(ADMIN_URL, { prefix: "oncely_bench" });
  const r = await createScratchRedis(REDIS_URL, "oncely_bench");
  const key = await createApiKey(db.sql, "bench");
  try {
    let previous: number | undefined;
    for (const [variant, label] of VARIANTS) {
      const port = freePort();
      progress(`ingest profile: ${variant}`);
      const server = await startIngestServer(variant, port, db.url, r.prefix, "./ingest_variants.ts");
      try {
        const runs: HttpLoad[] = [];
        const cpu: number[] = [];
        for (let i = 0; i < (smoke ? 1 : 3); i++) {
          const before = await cpuMs(server.pid);
          runs.push(
            await postLoad({
              url: `http://127.0.0.1:${port}/v1/summaries`,
              headers: { authorization: `Bearer ${key}`, "content-type": "application/json" },
              body: BODY,
              vary: {
                header: "idempotency-key",
                prefix: `profile-${variant}-${i}-${crypto.randomUUID().slice(0, 8)}-`,
              },
              connections: 64,
              seconds: smoke ? 1 : 3,
              expectStatus: 202,
            }, progress),
          );
          const last = runs[runs.length - 1]!;
          cpu.push(((await cpuMs(server.pid)) - before) * 1000 / (last.perSecond * (smoke ? 1 : 3)));
        }
        const rps = median(runs.map((x) => x.perSecond));
        // The server's CPU per request (from /proc): steadier than the rate on a shared machine.
        const cpuUs = median(cpu);
        rows.push({
          benchmark: `Ingest profile: ${label}`,
          result: `${fmt(rps)}/s, server CPU ${fmt(cpuUs)} µs per request`,
          baseline: previous === undefined ? "" : `previous step ${fmt(previous)} µs`,
          ratio: previous === undefined ? "" : `${cpuUs >= previous ? "+" : ""}${fmt(cpuUs - previous)} µs`,
          value: rps,
        });
        previous = cpuUs;
      } finally {
        await server.stop();
      }
    }
  } finally {
    await r.close();
    await db.close();
  }
}

/** Runs `worker` until `allDone` resolves (at most 120 s), then stops it. @returns whether it finished, and the seconds it took. */
async function runUntil(worker: StreamWorker, allDone: Promise<void>): Promise<{ ok: boolean; seconds: number }> {
  const stop = new AbortController();
  const started = performance.now();
  const running = worker.run(stop.signal);
  const ok = await settlesWithin(allDone, 120_000);
  const seconds = (performance.now() - started) / 1000;
  stop.abort();
  await running;
  await worker.close();
  return { ok, seconds };
}

/** Runs one worker over `jobs` pre-enqueued jobs; returns jobs/s until every one is acked. */
async function workerRun(opts: { jobs: number; concurrency: number; delayMs: number }): Promise<number> {
  const db = await createScratchDatabase(ADMIN_URL, { prefix: "oncely_bench", max: 10 });
  const r = await createScratchRedis(REDIS_URL, "oncely_bench");
  try {
    const keys = serviceKeys(r.prefix);
    await enqueueMany(r, opts.jobs, keys);
    let acked = 0;
    let finished!: () => void;
    const allDone = new Promise<void>((res) => (finished = res));
    const worker = createSummaryWorker(
      {
        redis: r.redis,
        sql: db.sql,
        models: createDeployment({ llm: fixedLlm(opts.delayMs), model: "bench" }),
        log: silentLogger,
      },
      {
        keys,
        consumer: "bench",
        claimIdleMs: 60_000,
        maxDeliveries: 5,
        concurrency: opts.concurrency,
        blockMs: 5,
        job: { budgetMs: 30_000, perCallTimeoutMs: 20_000, maxAttempts: 1 },
        events: {
          acked() {
            if (++acked === opts.jobs) finished();
          },
        },
      },
    );
    const { ok, seconds } = await runUntil(worker, allDone);
    if (!ok) throw new Error(`worker bench: only ${acked}/${opts.jobs} jobs acked in 120 s`);
    const committed = await countRows(db.sql, "summaries");
    if (committed !== opts.jobs) throw new Error(`worker bench: ${committed} summaries for ${opts.jobs} jobs`);
    return opts.jobs / seconds;
  } finally {
    await r.close();
    await db.close();
  }
}

async function pgbenchPerJobTransaction(seconds: number): Promise<number> {
  const db = await createScratchDatabase(ADMIN_URL, { prefix: "oncely_bench", max: 1 });
  const script = await Deno.makeTempFile({ suffix: ".sql" });
  try {
    await Deno.writeTextFile(
      script,
      `\\set n random(1, 9000000000000000000)
BEGIN;
INSERT INTO summaries (job_id, tenant, summary) VALUES (md5(:n::text)::uuid, 'bench', 'Revenue rose.') ON CONFLICT (job_id) DO NOTHING RETURNING job_id;
INSERT INTO outbox (topic, dedupe_key, payload) VALUES ('email.summary_ready', 'summary_ready:' || md5(:n::text)::uuid, '{"to":"ops@example.com"}'::jsonb) ON CONFLICT (dedupe_key) DO NOTHING;
COMMIT;
`,
    );
    const u = new URL(db.url);
    const out = await new Deno.Command("pgbench", {
      args: [
        "-n",
        "-c",
        "16",
        "-j",
        "2",
        "-T",
        String(Math.max(1, Math.round(seconds))),
        "-f",
        script,
        "-h",
        u.hostname,
        "-p",
        u.port || "5432",
        "-U",
        decodeURIComponent(u.username || "postgres"),
        u.pathname.slice(1),
      ],
      stdout: "piped",
      stderr: "piped",
    }).output();
    const text = new TextDecoder().decode(out.stdout);
    const tps = /tps = ([\d.]+)/.exec(text);
    if (!out.success || !tps) throw new Error(`pgbench failed: ${new TextDecoder().decode(out.stderr)}`);
    return Number(tps[1]);
  } finally {
    await Deno.remove(script);
    await db.close();
  }
}

async function benchWorker() {
  const slowJobs = smoke ? 300 : 8000;
  progress(`worker: ${slowJobs} jobs, 200 ms model, concurrency 256`);
  const slow: number[] = [];
  for (let i = 0; i < RUNS; i++) slow.push(await workerRun({ jobs: slowJobs, concurrency: 256, delayMs: 200 }));
  const ideal = 256 / 0.2;
  rows.push({
    benchmark: "Queue-and-commit core (in-process stub model, no model path): jobs/s, 200 ms stub, concurrency 256",
    result: `${fmt(median(slow))}/s`,
    baseline: `ideal 256 / 0.2 s = ${fmt(ideal)}/s`,
    ratio: `${fmt(median(slow) / ideal, 2)}x`,
    goal: `>= 0.9x ${median(slow) / ideal >= 0.9 ? "(met)" : "(NOT met)"}`,
    value: median(slow),
    baselineValue: ideal,
  });
  const fastJobs = smoke ? 500 : 10_000;
  progress(`worker: ${fastJobs} jobs, instant model, with Postgres; pgbench baseline`);
  const fast: number[] = [], pg: number[] = [];
  for (let i = 0; i < RUNS; i++) {
    fast.push(await workerRun({ jobs: fastJobs, concurrency: 256, delayMs: 0 }));
    pg.push(await pgbenchPerJobTransaction(smoke ? 1 : 5));
  }
  rows.push({
    benchmark:
      "Queue-and-commit core (in-process stub model, no model path): jobs/s, instant stub, incl. Postgres commit",
    result: `${fmt(median(fast))}/s`,
    baseline: `pgbench, same per-job transaction, 16 clients: ${fmt(median(pg))} tx/s`,
    ratio: `${fmt(median(fast) / median(pg), 2)}x`,
    goal: `> 1x ${median(fast) > median(pg) ? "(met)" : "(NOT met)"}`,
    value: median(fast),
    baselineValue: median(pg),
  });
}

/** Redis's own CPU time so far (user + system, every thread), in ms, from `INFO cpu`. */
async function redisCpuMs(redis: Redis): Promise<number> {
  const info = await redis.info("cpu");
  const field = (name: string) => Number(new RegExp(`^${name}:([\\d.]+)`, "m").exec(info)?.[1] ?? NaN);
  return (field("used_cpu_user") + field("used_cpu_sys")) * 1000;
}

/** A difference with its sign. */
const signed = (n: number, digits: number) => `${n >= 0 ? "+" : ""}${fmt(n, digits)}`;

/** Prices for every model, in the budget rows' runs with and without a budget alike. */
const BENCH_PRICES = { LLM_PRICE_IN_PER_MTOK: "0.4", LLM_PRICE_OUT_PER_MTOK: "1.6" };

/** Jobs a worker process runs first, unmeasured, as the SDK alone makes its calls after a warm-up. */
const WORKER_WARM_UP_JOBS = 500;

/**
 * The real worker process (main.ts worker, the openai SDK over HTTP) over a backlog of `jobs` jobs; jobs/s and
 * CPU ms per job. Summary jobs, or with `task`, runs of that task (stored as version 1 first). As the SDK alone
 * is measured after a warm-up, the worker first runs a few hundred jobs unmeasured (its connections open, its
 * code compiled, the provider's limits learned); then the backlog is queued without a wake-up, and the clock
 * starts when the lane is announced: what is measured is the worker draining a queue, not the bench's own
 * enqueuing competing with it for the machine's two cores.
 * With `budget`, the tenant has budgets in tokens and USD per day that the jobs never reach, so every call is
 * reserved and settled (checked afterwards: the budget's spend is every call's reported usage). With `lanes`, the
 * backlog is summary jobs of `lanes.request` spread round robin over `lanes.tenants` tenants ({@linkcode laneTenant}),
 * none of them the warm-up's, and the clock starts when all their lanes are announced at once. CPU ms per job is
 * the worker's, the fake model's and Redis's.
 */
async function workerProcessRun(
  model: { url: string; pid: number },
  jobs: number,
  task?: { name: string; body: unknown },
  options: {
    budget?: boolean;
    env?: Record<string, string>;
    /**
     * The backlog spread over `tenants` lanes; `newcomer`: 1 s after the clock starts, one job of a tenant with no
     * backlog is queued and announced, and the run says how long it took to be decided (fairness at scale).
     */
    lanes?: { tenants: number; request: SummaryRequest; newcomer?: boolean };
  } = {},
) {
  const db = await createScratchDatabase(ADMIN_URL, { prefix: "oncely_bench" });
  const url = await emptyRedisDatabase(REDIS_URL);
  const redis = new Redis(url, { maxRetriesPerRequest: 1 });
  const worker = await startWorkerProcess({
    DATABASE_URL: db.url,
    REDIS_URL: url,
    OPENAI_API_KEY: "sk-bench",
    OPENAI_BASE_URL: model.url,
    WORKER_CONCURRENCY: "256",
    LLM_RPM: "",
    LLM_TPM: "",
    LOG_LEVEL: "info",
    ...options.env,
  });
  try {
    const keys = serviceKeys(KEY_PREFIX);
    if (task) await putTaskVersion(db.sql, "bench", task.name, storedDefinition(task.body));
    if (options.budget) {
      await createApiKey(db.sql, "bench");
      await setTenantBudget(db.sql, "bench", { "--tokens-per-day": 1e12, "--usd-per-day": 1e6 });
    }
    const enqueue = (i: number, announce: boolean) =>
      task
        ? enqueueRunToLane(redis, keys, {
          jobId: crypto.randomUUID(),
          tenant: "bench",
          run: { task: task.name, version: 1, input: triageInput(i) },
        }, { announce })
        : announce
        ? enqueueToLane(redis, keys, { jobId: crypto.randomUUID(), tenant: "bench", request: JSON.parse(BODY) })
        : enqueueJob(redis, keys.lane("bench"), {
          jobId: crypto.randomUUID(),
          tenant: "bench",
          request: JSON.parse(BODY),
        });
    // Every job decided (a run whose answer failed its schema is decided failed): then all must be done.
    const decided = async () => {
      const [row] = await db.sql<{ n: number; done: number }[]>`
        SELECT count(*)::int AS n, (count(*) FILTER (WHERE outcome = 'done'))::int AS done FROM job_outcomes
        WHERE tenant <> 'newcomer'`;
      return row!;
    };
    // At least 50 jobs/s, and never less than 180 s: a backlog over thousands of lanes may drain that slowly.
    const boundS = Math.max(180, Math.ceil(jobs / 50));
    // Polled less often while far from done: a count over job_outcomes costs Postgres more as the table grows (a
    // count every 20 ms through a drain of 150,000 jobs took a growing share of the cores the worker runs on).
    const until = async (n: number, what: string) => {
      const end = performance.now() + boundS * 1000;
      let last = { at: performance.now(), got: 0 };
      for (;;) {
        const got = (await decided()).n;
        if (got >= n) return;
        if (performance.now() > end) throw new Error(`worker process: ${what}: fewer than ${n} decided in ${boundS} s`);
        const now = performance.now();
        const perMs = (got - last.got) / Math.max(1, now - last.at);
        last = { at: now, got };
        // A quarter of the time left at the rate seen, between 20 ms and 1 s.
        await sleep(perMs > 0 ? Math.min(1_000, Math.max(20, (n - got) / perMs / 4)) : 20);
      }
    };
    const warmUp = smoke ? 20 : WORKER_WARM_UP_JOBS;
    await Promise.all(Array.from({ length: warmUp }, (_, i) => enqueue(i, true)));
    await until(warmUp, "warm-up");
    // The worker has found the lane empty and left it: the backlog below waits unseen until it is announced.
    for (const end = performance.now() + 10_000; await redis.sismember(keys.registry.active, "bench");) {
      if (performance.now() > end) throw new Error("worker process: the lane stayed active after the warm-up");
      await sleep(20);
    }
    if (options.lanes) await queueSpread(redis, keys, jobs, options.lanes);
    else await Promise.all(Array.from({ length: jobs }, (_, i) => enqueue(warmUp + i, false)));
    const before = await cpuMs(worker.pid);
    const modelBefore = await cpuMs(model.pid);
    const redisBefore = await redisCpuMs(redis);
    const started = performance.now();
    if (options.lanes) {
      await announceAll(redis, keys, Array.from({ length: options.lanes.tenants }, (_, i) => laneTenant(i + 1)));
    } else await announceLane(redis, keys.registry, "bench");
    const newcomer = options.lanes?.newcomer ? newcomerDecidedS(redis, db.sql, keys, options.lanes.request) : undefined;
    await until(warmUp + jobs, "backlog");
    const seconds = (performance.now() - started) / 1000;
    const newcomerS = await newcomer;
    const after = await cpuMs(worker.pid);
    const modelAfter = await cpuMs(model.pid);
    const redisAfter = await redisCpuMs(redis);
    const { done } = await decided();
    const results = task ? await countRows(db.sql, "run_results") : await countRows(db.sql, "summaries");
    const expected = warmUp + jobs;
    if (done !== expected || results !== expected + (newcomer ? 1 : 0)) {
      throw new Error(`worker process: ${done}/${expected} done, ${results} results written`);
    }
    if (options.budget) {
      // Every call reserved and settled: the fake model reports 1 + 1 tokens a call, and one call a job.
      const { spent, reserved } = await readBudgetState(redis, serviceKeys(KEY_PREFIX).budget("bench"));
      if (spent[0] !== 2 * (warmUp + jobs) || reserved[0] !== 0) {
        throw new Error(
          `worker process: the budget spent ${spent[0]} tokens (reserved ${reserved[0]}) for ${warmUp + jobs} jobs`,
        );
      }
    }
    return {
      perSecond: jobs / seconds,
      newcomerS,
      cpuMsPerJob: (after - before) / jobs,
      modelCpuMsPerJob: (modelAfter - modelBefore) / jobs,
      redisCpuMsPerJob: (redisAfter - redisBefore) / jobs,
    };
  } finally {
    await worker.stop();
    await redis.quit();
    await releaseRedisDatabase(url).catch(() => {});
    await db.close();
  }
}

/**
 * The real worker process against its ceilings, in one run, medians of three: with a 200 ms model, the SDK alone
 * on the same fake model at the same concurrency (goal: 0.9x); with an instant model, the lower of the SDK alone
 * and `pgbench` running the same per-job transaction (goal: 0.75x).
 */
async function benchWorkerProcess() {
  for (const delayMs of [200, 0]) {
    const jobs = smoke ? 300 : delayMs ? 6_000 : 5_000;
    const model = await startModelProcess(delayMs);
    const label = delayMs ? `${delayMs} ms model` : "instant model";
    try {
      const sdk: { perSecond: number; cpuMsPerCall: number }[] = [];
      const ours: { perSecond: number; cpuMsPerJob: number }[] = [];
      const pg: number[] = [];
      for (let i = 0; i < RUNS; i++) {
        progress(`worker process: ${jobs} jobs, ${label}, concurrency 256: SDK alone, then the worker (run ${i + 1})`);
        sdk.push(await sdkCeiling(model.url, 256, jobs));
        ours.push(await workerProcessRun(model, jobs));
        if (!delayMs) pg.push(await pgbenchPerJobTransaction(smoke ? 1 : 5));
        progress(
          `worker process: SDK alone ${fmt(sdk.at(-1)!.perSecond)}/s, worker ${fmt(ours.at(-1)!.perSecond)}/s` +
            (delayMs ? "" : `, pgbench ${fmt(pg.at(-1)!)} tx/s`),
        );
      }
      const rate = median(ours.map((x) => x.perSecond));
      const ceiling = median(sdk.map((x) => x.perSecond));
      const cpuJob = median(ours.map((x) => x.cpuMsPerJob));
      const cpuCall = median(sdk.map((x) => x.cpuMsPerCall));
      const floor = delayMs ? ceiling : Math.min(ceiling, median(pg));
      const goal = delayMs ? 0.9 : 0.75;
      rows.push({
        benchmark: `Worker jobs/s, real worker process, openai SDK over HTTP, ${label}, WORKER_CONCURRENCY=256`,
        result: `${fmt(rate)}/s; CPU ${fmt(cpuJob, 2)} ms/job, of which ${
          fmt(cpuJob - cpuCall, 2)
        } ms beyond the SDK call`,
        baseline: `SDK alone, same model and concurrency: ${fmt(ceiling)} calls/s, CPU ${fmt(cpuCall, 2)} ms/call` +
          (delayMs ? "" : `; pgbench, same per-job transaction, 16 clients: ${fmt(median(pg))} tx/s`),
        ratio: `${fmt(rate / floor, 2)}x`,
        goal: `>= ${goal}x ${delayMs ? "of the SDK alone" : "of the lower"} ${
          rate / floor >= goal ? "(met)" : "(NOT met)"
        }`,
        value: rate,
        baselineValue: floor,
      });
    } finally {
      await model.stop();
    }
  }
}

/**
 * The real worker process running a task with an output schema (strict json_schema, the answer parsed and
 * validated) against the same task without one (text), on one fake model process, the two alternating.
 */
async function benchWorkerProcessTasks() {
  // Smoke: only that both paths run, so only the instant model and a few jobs.
  for (const delayMs of smoke ? [0] : [200, 0]) {
    const jobs = smoke ? 100 : delayMs ? 6_000 : 5_000;
    const model = await startModelProcess(delayMs);
    const label = delayMs ? `${delayMs} ms model` : "instant model";
    try {
      const runs: Record<"json" | "text", Awaited<ReturnType<typeof workerProcessRun>>[]> = { json: [], text: [] };
      for (let i = 0; i < RUNS; i++) {
        const order = i % 2 === 0 ? (["json", "text"] as const) : (["text", "json"] as const);
        for (const kind of order) {
          progress(`worker process, task runs: ${jobs} runs, ${label}, ${kind} output (run ${i + 1})`);
          const run = await workerProcessRun(model, jobs, { name: `triage-${kind}`, body: TRIAGE_BODIES[kind] });
          progress(
            `worker process, task runs: ${kind}: ${fmt(run.perSecond)}/s, CPU ${fmt(run.cpuMsPerJob, 2)} ms/run`,
          );
          runs[kind].push(run);
        }
      }
      const rate = (kind: keyof typeof runs) => median(runs[kind].map((x) => x.perSecond));
      const cpu = (kind: keyof typeof runs) => median(runs[kind].map((x) => x.cpuMsPerJob));
      const modelCpu = (kind: keyof typeof runs) => median(runs[kind].map((x) => x.modelCpuMsPerJob));
      rows.push({
        benchmark: `Worker runs/s of a task with an output schema (structured output, validated), real worker ` +
          `process, openai SDK over HTTP, ${label}, WORKER_CONCURRENCY=256`,
        result: `${fmt(rate("json"))}/s; worker CPU ${fmt(cpu("json"), 2)} ms/run ` +
          `(fake model's ${fmt(modelCpu("json"), 2)} ms)`,
        baseline: `same task without an output schema (text), same run: ${fmt(rate("text"))}/s; ` +
          `worker CPU ${fmt(cpu("text"), 2)} ms/run (fake model's ${fmt(modelCpu("text"), 2)} ms)`,
        ratio: `${fmt(rate("json") / rate("text"), 2)}x`,
        value: rate("json"),
        baselineValue: rate("text"),
      });
    } finally {
      await model.stop();
    }
  }
}

/**
 * The two budget scripts alone, as a worker runs them around one call (reserve, then settle at the charge), one
 * caller after another, against a PING round trip on the same connection: what a budget adds to one call's path.
 */
async function benchBudgetScripts() {
  const n = smoke ? 200 : 5_000;
  const url = await emptyRedisDatabase(REDIS_URL);
  const redis = new Redis(url, { maxRetriesPerRequest: 1 });
  try {
    const key = serviceKeys(KEY_PREFIX).budget("bench");
    // Budgets in tokens and USD per day, never reached; a call's worst case and its charge as a summary's.
    const limits: Limits = [1e12, 1e15, -1, -1];
    const worst = { tokens: 1_400, nanos: 1_800_000 }, charge = { tokens: 150, nanos: 100_000 };
    const pairs: number[] = [], pings: number[] = [];
    // As the worker's budgets do before the first call: a settle refuses a hash never seeded.
    await seedBudgetState(redis, key, [0, 0, 0, 0]);
    for (let i = 0; i < n + 200; i++) {
      let t = performance.now();
      const reply = await runReserve(redis, key, limits, worst);
      await runSettle(redis, key, reply, worst, charge, limits);
      if (i >= 200) pairs.push((performance.now() - t) * 1000);
      t = performance.now();
      await redis.ping();
      if (i >= 200) pings.push((performance.now() - t) * 1000);
    }
    const { spent, reserved } = await readBudgetState(redis, key);
    if (spent[0] !== (n + 200) * charge.tokens || reserved[0] !== 0) {
      throw new Error(`budget scripts: spent ${spent[0]}, reserved ${reserved[0]} after ${n + 200} calls`);
    }
    rows.push({
      benchmark:
        "Budget scripts alone: reserve + settle around one call, one caller, sequential, tokens and USD per day",
      result: `p50 ${fmt(median(pairs))} µs, p99 ${fmt(quantile(pairs, 0.99))} µs per call`,
      baseline: `PING round trip, same connection: p50 ${fmt(median(pings))} µs, p99 ${fmt(quantile(pings, 0.99))} µs`,
      ratio: `${fmt(median(pairs) / median(pings), 1)}x`,
      value: median(pairs),
      baselineValue: median(pings),
    });
  } finally {
    await redis.quit();
    await releaseRedisDatabase(url).catch(() => {});
  }
}

/**
 * The cost of the budgets on the worker's path: the real worker process over summary jobs of a tenant with a
 * budget (each call reserved before and settled after, two more scripts in Redis) against the same jobs of a
 * tenant without one (no Redis round trip for budgets), on one fake model process, alternating.
 */
async function benchWorkerProcessBudget() {
  await benchBudgetScripts();
  // Smoke: only that both paths run, so only the instant model and a few jobs.
  for (const delayMs of smoke ? [0] : [200, 0]) {
    const jobs = smoke ? 100 : delayMs ? 6_000 : 5_000;
    const model = await startModelProcess(delayMs);
    const label = delayMs ? `${delayMs} ms model` : "instant model";
    try {
      const runs: Record<"budget" | "none", Awaited<ReturnType<typeof workerProcessRun>>[]> = { budget: [], none: [] };
      for (let i = 0; i < RUNS; i++) {
        const order = i % 2 === 0 ? (["budget", "none"] as const) : (["none", "budget"] as const);
        for (const kind of order) {
          progress(
            `worker process, budgets: ${jobs} jobs, ${label}, ${kind === "budget" ? "with" : "without"} (run ${i + 1})`,
          );
          const run = await workerProcessRun(model, jobs, undefined, { budget: kind === "budget", env: BENCH_PRICES });
          const cpuText = `worker CPU ${fmt(run.cpuMsPerJob, 2)}, Redis CPU ${fmt(run.redisCpuMsPerJob, 3)} ms/job`;
          progress(`worker process, budgets: ${kind}: ${fmt(run.perSecond)}/s, ${cpuText}`);
          runs[kind].push(run);
        }
      }
      const rate = (kind: keyof typeof runs) => median(runs[kind].map((x) => x.perSecond));
      const cpu = (kind: keyof typeof runs) => median(runs[kind].map((x) => x.cpuMsPerJob));
      const redisCpu = (kind: keyof typeof runs) => median(runs[kind].map((x) => x.redisCpuMsPerJob));
      rows.push({
        benchmark: `Worker jobs/s, tenant with a budget (tokens and USD per day: every call reserved and settled), ` +
          `real worker process, openai SDK over HTTP, ${label}, WORKER_CONCURRENCY=256`,
        result: `${fmt(rate("budget"))}/s; worker CPU ${fmt(cpu("budget"), 2)} ms/job (${
          signed(cpu("budget") - cpu("none"), 2)
        }), Redis CPU ${fmt(redisCpu("budget"), 3)} ms/job (${signed(redisCpu("budget") - redisCpu("none"), 3)})`,
        baseline: `same jobs, tenant without a budget, same run: ${fmt(rate("none"))}/s; worker CPU ${
          fmt(cpu("none"), 2)
        } ms/job, Redis CPU ${fmt(redisCpu("none"), 3)} ms/job`,
        ratio: `${fmt(rate("budget") / rate("none"), 2)}x`,
        value: rate("budget"),
        baselineValue: rate("none"),
      });
    } finally {
      await model.stop();
    }
  }
}

/**
 * Tenant B posts 8 jobs while tenant A has a backlog, on one worker with 8
 * slots and a 250 ms model: how long B waits, with lanes and with the one
 * FIFO stream of earlier releases (the baseline). Then two equal backlogs.
 */
async function benchFairness() {
  const delayMs = smoke ? 50 : 250;
  const backlog = smoke ? 40 : 240;
  const run = async (lanes: boolean) => {
    const db = await createScratchDatabase(ADMIN_URL, { prefix: "oncely_bench" });
    const r = await createScratchRedis(REDIS_URL, "oncely_bench");
    const service = serviceKeys(r.prefix);
    // The baseline: every tenant's jobs in one lane's stream, read in the order they came, as before lanes.
    const fifo = service.lane("fifo");
    const enqueue = async (tenant: string, i: number) => {
      const job = {
        jobId: crypto.randomUUID(),
        tenant,
        request: { text: `${tenant} ${i}. Revenue rose.`, notify: "o@x.co" },
      };
      if (lanes) await enqueueToLane(r.redis, service, job);
      else {
        await enqueueJob(r.redis, fifo, job);
        await announceLane(r.redis, service.registry, "fifo");
      }
      return job.jobId;
    };
    const worker = summaryWorker(
      { redis: r.redis, sql: db.sql, llm: fixedLlm(delayMs), keys: service },
      {
        consumer: "fair",
        concurrency: 8,
        blockMs: 50,
        job: { budgetMs: 60_000, perCallTimeoutMs: 30_000, maxAttempts: 1 },
      },
    );
    const stop = new AbortController();
    const running = worker.run(stop.signal);
    try {
      for (let i = 0; i < backlog; i++) await enqueue("a", i);
      await sleep(delayMs * 2); // A is under way
      const posted = performance.now();
      const bIds = [];
      for (let i = 0; i < 8; i++) bIds.push(await enqueue("b", i));
      for (;;) {
        const [row] = await db.sql<
          { n: number }[]
        >`SELECT count(*)::int AS n FROM summaries WHERE job_id = ANY(${bIds})`;
        if (row!.n === 8) break;
        if (performance.now() - posted > 120_000) throw new Error("fairness: B not done in 120 s");
        await sleep(10);
      }
      return (performance.now() - posted) / 1000;
    } finally {
      stop.abort();
      await running;
      await worker.close();
      await r.close();
      await db.close();
    }
  };
  progress(`fairness: B's 8 jobs behind A's ${backlog}, ${delayMs} ms model, 8 slots: lanes, then one FIFO stream`);
  const withLanes = await run(true);
  const fifo = await run(false);
  // Issue 20: B's 8 within 1 s of their POSTs (a fair share of 4 slots needs about 0.5 s).
  const goal = smoke ? 0.5 : 1;
  rows.push({
    benchmark:
      `Fairness: tenant B's 8 jobs posted behind tenant A's ${backlog} (${fmt((backlog * delayMs) / 8 / 1000, 1)} s ` +
      `backlog), one worker, 8 slots, ${delayMs} ms model`,
    result: `with lanes, B done ${fmt(withLanes, 2)} s after posting`,
    baseline: `one FIFO stream (before lanes): ${fmt(fifo, 2)} s`,
    ratio: `${fmt(fifo / withLanes, 1)}x sooner`,
    goal: `<= ${goal} s ${withLanes <= goal ? "(met)" : "(NOT met)"}`,
    value: withLanes,
    baselineValue: fifo,
  });
}

/**
 * The provider's tokens shared by tenant: A queues 100 documents of about 4,000 tokens, then B queues 20 of
 * about 100, under 60,000 tokens per minute (the provider enforcing it with headers and 429s), one worker
 * process. The baseline is what job-count round robin allows: each of B's jobs goes with one of A's.
 */
async function benchTokenShare() {
  const tpm = smoke ? 600_000 : 60_000;
  const heavy = { jobs: smoke ? 20 : 100, tokens: 4_000 };
  const light = { jobs: smoke ? 5 : 20, tokens: 100 };
  const runs: TokenShareRun[] = [];
  for (let i = 0; i < RUNS; i++) {
    progress(
      `token share: B's ${light.jobs} small documents behind A's ${heavy.jobs} large ones, ${tpm} tokens/min ` +
        `(run ${i + 1})`,
    );
    runs.push(await tokenShareRun({ tpm, heavy, light, adminUrl: ADMIN_URL, redisUrl: REDIS_URL }));
  }
  const mid = runs.find((r) => r.seconds === median(runs.map((x) => x.seconds)))!;
  // Job-count round robin: one of A's documents goes with each of B's, and each pair waits for its tokens.
  const roundRobin = (light.jobs * (heavy.tokens + light.tokens) * 60) / tpm;
  const goal = smoke ? 5 : 15;
  rows.push({
    benchmark: `Token share: tenant B's ${light.jobs} documents of ~${light.tokens} tokens queued behind tenant A's ` +
      `${heavy.jobs} of ~${fmt(heavy.tokens)}, ${fmt(tpm)} tokens/min (provider headers and 429s), one worker process`,
    result: `B done ${fmt(mid.seconds, 1)} s after queueing (A: ${mid.aDone} done meanwhile); ` +
      `${mid.rateLimited}/${mid.calls} calls answered 429`,
    baseline: `job-count round robin: ${fmt(roundRobin, 0)} s (computed)`,
    ratio: `${fmt(roundRobin / mid.seconds, 1)}x sooner`,
    goal: `<= ${goal} s ${mid.seconds <= goal ? "(met)" : "(NOT met)"}`,
    value: mid.seconds,
    baselineValue: roundRobin,
  });
}

/**
 * The relay's emails/s as a relay process sends them (its run loop: sends kept in flight, claims as slots free),
 * against the same relay claiming a batch, sending it all and claiming again (`runOnce`), alternating.
 */
async function benchRelay() {
  const n = smoke ? 500 : 10_000;
  const results: Record<string, number[]> = {};
  for (const batch of [20, 200]) {
    for (let i = 0; i < RUNS * 2; i++) {
      const mode = i % 2 === 0 ? "loop" : "batches";
      progress(`relay: ${n} emails, RELAY_BATCH=${batch}, ${mode}, run ${Math.floor(i / 2) + 1}`);
      const db = await createScratchDatabase(ADMIN_URL, { prefix: "oncely_bench" });
      const mail = startFakeMail();
      try {
        for (let start = 0; start < n; start += 1000) {
          await commitResults(
            db.sql,
            Array.from({ length: Math.min(1000, n - start) }, () => ({
              jobId: crypto.randomUUID(),
              tenant: "bench",
              summary: "Revenue rose.",
              notify: "ops@example.com",
            })),
          );
        }
        const relay = relayTo({
          sql: db.sql,
          mailer: createResendMailer({ apiKey: "re_bench", baseUrl: mail.url, timeoutMs: 10_000 }),
        }, { batch, maxAttempts: 10, leaseMs: 30_000 });
        const started = performance.now();
        if (mode === "batches") {
          while ((await relay.runOnce()) > 0) { /* drain */ }
        } else {
          const stop = new AbortController();
          const running = relay.run(stop.signal);
          while (mail.delivered.length < n && performance.now() - started < 120_000) await sleep(2);
          stop.abort();
          await running;
        }
        const seconds = (performance.now() - started) / 1000;
        const sent = await countRows(db.sql, "outbox", true);
        if (sent !== n || mail.delivered.length !== n) {
          throw new Error(`relay bench: ${sent} sent, ${mail.delivered.length} delivered`);
        }
        (results[`${batch}/${mode}`] ??= []).push(n / seconds);
      } finally {
        await mail.close();
        await db.close();
      }
    }
  }
  for (const batch of [20, 200]) {
    const v = median(results[`${batch}/loop`]!);
    const batches = median(results[`${batch}/batches`]!);
    rows.push({
      benchmark: `Relay emails/s, one relay (its run loop), instant local provider, RELAY_BATCH=${batch}`,
      result: `${fmt(v)}/s`,
      baseline: `claim ${batch}, send them all, claim again (runOnce), alternating: ${fmt(batches)}/s`,
      ratio: `${fmt(v / batches, 2)}x`,
      goal: `>= 3,000/s ${v >= 3000 ? "(met)" : "(NOT met)"}`,
      value: v,
      baselineValue: batches,
    });
  }
}

async function benchEndToEnd() {
  const rate = 200;
  const seconds = smoke ? 1 : 10;
  progress(`end to end: ${rate} jobs/s for ${seconds} s, instant model`);
  const db = await createScratchDatabase(ADMIN_URL, { prefix: "oncely_bench" });
  const r = await createScratchRedis(REDIS_URL, "oncely_bench");
  const arrivals = new Map<string, number>();
  const mail = startFakeMail();
  // The service's key layout: each tenant's lane, woken by the publish after each enqueue.
  const keys = serviceKeys(r.prefix);
  const key = await createApiKey(db.sql, "bench");
  const handler = apiHandler({ redis: r.redis, sql: db.sql, keys }, {
    authMode: "api-key",
    authCacheTtlMs: 10_000,
    resultTtlS: 600,
  });
  const worker = summaryWorker({ redis: r.redis, sql: db.sql, llm: fixedLlm(0), keys }, {
    consumer: "e2e",
    concurrency: 64,
    blockMs: 1_000,
    job: { budgetMs: 30_000, perCallTimeoutMs: 20_000, maxAttempts: 1 },
  });
  const baseMailer = createResendMailer({ apiKey: "re_bench", baseUrl: mail.url, timeoutMs: 10_000 });
  const relay = relayTo({
    sql: db.sql,
    mailer: {
      async send(email, idempotencyKey, signal) {
        const result = await baseMailer.send(email, idempotencyKey, signal);
        arrivals.set(idempotencyKey.slice(SUMMARY_READY_KEY_PREFIX.length), performance.now());
        return result;
      },
    },
  }, { maxAttempts: 10, leaseMs: 30_000, pollMs: 2_000 });
  const stop = new AbortController();
  const loops = [worker.run(stop.signal), relay.run(stop.signal)];
  const accepted = new Map<string, number>();
  try {
    await sleep(200);
    const total = rate * seconds;
    const started = performance.now();
    const posts: Promise<void>[] = [];
    for (let i = 0; i < total; i++) {
      const due = started + (i * 1000) / rate;
      const wait = due - performance.now();
      if (wait > 0) await sleep(wait);
      posts.push((async () => {
        const res = await handler(
          new Request("http://bench/v1/summaries", {
            method: "POST",
            headers: {
              authorization: `Bearer ${key}`,
              "content-type": "application/json",
              "idempotency-key": `e2e-${crypto.randomUUID()}`,
            },
            body: BODY,
          }),
        );
        const t = performance.now();
        const { job_id } = await res.json();
        accepted.set(job_id, t);
      })());
    }
    await Promise.all(posts);
    const deadline = performance.now() + 30_000;
    while (arrivals.size < total && performance.now() < deadline) await sleep(20);
    if (arrivals.size < total) throw new Error(`end to end: ${arrivals.size}/${total} emails arrived`);
    const latencies = [...accepted].map(([id, t]) => arrivals.get(id)! - t);
    const p50 = quantile(latencies, 0.5), p99 = quantile(latencies, 0.99);
    rows.push({
      benchmark: `End-to-end 202 -> provider receives email, instant model, ${rate} jobs/s`,
      result: `p50 ${fmt(p50, 1)} ms, p99 ${fmt(p99, 1)} ms`,
      goal: `p50 < 20 ms ${p50 < 20 ? "(met)" : "(NOT met)"}`,
      value: p50,
    });
  } finally {
    stop.abort();
    await Promise.all(loops);
    await worker.close();
    await mail.close();
    await r.close();
    await db.close();
  }
}

async function benchMemory() {
  const inFlight = smoke ? 200 : 1000;
  progress(`memory: worker RSS with ${inFlight} jobs in flight`);
  const db = await createScratchDatabase(ADMIN_URL, { prefix: "oncely_bench" });
  const r = await createScratchRedis(REDIS_URL, "oncely_bench");
  const keys = serviceKeys(r.prefix);
  const stop = new AbortController();
  try {
    await enqueueMany(r, inFlight, keys);
    (globalThis as { gc?: () => void }).gc?.();
    const before = Deno.memoryUsage().rss;
    const models = createDeployment({ llm: fixedLlm(60_000), model: "bench" });
    const worker = createSummaryWorker({ redis: r.redis, sql: db.sql, models, log: silentLogger }, {
      keys,
      consumer: "mem",
      claimIdleMs: 60_000,
      maxDeliveries: 5,
      concurrency: inFlight,
      blockMs: 5,
      graceMs: 100,
      job: { budgetMs: 120_000, perCallTimeoutMs: 100_000, maxAttempts: 1 },
    });
    const running = worker.run(stop.signal);
    const deadline = performance.now() + 30_000;
    while (worker.inFlight < inFlight && performance.now() < deadline) await sleep(20);
    const held = worker.inFlight;
    await sleep(300);
    const during = Deno.memoryUsage().rss;
    stop.abort();
    await running;
    await worker.close();
    rows.push({
      benchmark: `Worker RSS with ${held} jobs in flight`,
      result: `${fmt(during / 2 ** 20, 1)} MiB`,
      baseline: `same process before the worker: ${fmt(before / 2 ** 20, 1)} MiB`,
      ratio: `+${fmt((during - before) / 2 ** 20, 1)} MiB`,
      value: during,
      baselineValue: before,
    });
  } finally {
    await r.close();
    await db.close();
  }
}

/** Our stream worker with a no-op handler: jobs/s until `n` pre-enqueued messages are acked (and deleted). */
async function oursNoop(n: number, concurrency: number): Promise<number> {
  const r = await createScratchRedis(REDIS_URL, "oncely_bench");
  const stream = `${r.prefix}:{q}:stream`;
  const names = { stream, streams: [stream], dead: `${r.prefix}:{q}:dead`, group: "g" };
  try {
    for (let start = 0; start < n; start += 1000) {
      const p = r.redis.pipeline();
      for (let i = start; i < Math.min(n, start + 1000); i++) p.xadd(names.stream, "*", "i", String(i));
      await p.exec();
    }
    let acked = 0;
    let finished!: () => void;
    const allDone = new Promise<void>((res) => (finished = res));
    const worker = createStreamWorker({ redis: r.redis, log: silentLogger }, {
      lanes: staticLanes([names]),
      consumer: "noop",
      claimIdleMs: 60_000,
      maxDeliveries: 5,
      concurrency,
      blockMs: 5,
      events: {
        acked() {
          if (++acked === n) finished();
        },
      },
    }, () => Promise.resolve());
    const { ok, seconds } = await runUntil(worker, allDone);
    if (!ok) throw new Error(`queue bench (ours): ${acked}/${n} acked in 120 s`);
    return n / seconds;
  } finally {
    await r.close();
  }
}

/** BullMQ with a no-op processor on the same Redis, same concurrency: jobs/s until `n` pre-added jobs complete. */
async function bullmqNoop(n: number, concurrency: number): Promise<number> {
  // A specifier in a variable: `deno check` and the service's lockfile never see BullMQ (its msgpackr-extract
  // build script printed a warning box on every fresh machine's first start); the bench runs with --no-lock.
  const bullmq = "npm:bullmq@6.7.0";
  const { Queue, Worker } = await import(bullmq);
  const u = new URL(REDIS_URL);
  const connection = { host: u.hostname, port: Number(u.port || 6379), db: Number(u.pathname.slice(1) || 0) };
  const prefix = `oncely_bench_bullmq_${crypto.randomUUID().slice(0, 8)}`;
  const queue = new Queue("noop", { connection, prefix });
  try {
    for (let start = 0; start < n; start += 1000) {
      await queue.addBulk(Array.from({ length: Math.min(1000, n - start) }, (_, i) => ({ name: "j", data: { i } })));
    }
    let completed = 0;
    let finished!: () => void;
    const allDone = new Promise<void>((res) => (finished = res));
    const started = performance.now();
    // removeOnComplete keeps Redis bounded, as our XDEL does.
    const worker = new Worker("noop", async () => {}, {
      connection,
      prefix,
      concurrency,
      removeOnComplete: { count: 0 },
    });
    worker.on("completed", () => {
      if (++completed === n) finished();
    });
    const ok = await settlesWithin(allDone, 120_000);
    const seconds = (performance.now() - started) / 1000;
    await worker.close();
    if (!ok) throw new Error(`queue bench (BullMQ): ${completed}/${n} completed in 120 s`);
    return n / seconds;
  } finally {
    await queue.obliterate({ force: true }).catch(() => {});
    await queue.close();
  }
}

async function benchQueue() {
  const n = smoke ? 2_000 : 20_000;
  const ours: number[] = [], theirs: number[] = [];
  for (let i = 0; i < RUNS; i++) {
    progress(`queue: ${n} no-op jobs, concurrency 256, ours then BullMQ (run ${i + 1})`);
    ours.push(await oursNoop(n, 256));
    theirs.push(await bullmqNoop(n, 256));
  }
  const ratio = median(ours) / median(theirs);
  rows.push({
    benchmark: "Queue jobs/s, no-op handler, concurrency 256, same Redis",
    result: `ours ${fmt(median(ours))}/s`,
    baseline: `BullMQ 6.7 under Deno ${fmt(median(theirs))}/s`,
    ratio: `${fmt(ratio, 2)}x`,
    goal: `>= 1x ${ratio >= 1 ? "(met)" : "(NOT met)"}`,
    value: median(ours),
    baselineValue: median(theirs),
  });
}

async function benchProvider() {
  // The setting: two workers at concurrency 32, a provider limited to 10 requests/s, 200 jobs.
  const rps = smoke ? 20 : 10;
  const jobs = smoke ? 40 : 200;
  const ideal = jobs / rps;
  const goodput = async (rpm: number | undefined, label: string, goal: { time: number; limited: number }) => {
    const runs: ProviderRun[] = [];
    for (let i = 0; i < RUNS; i++) {
      progress(`provider: ${jobs} jobs, 2 workers, limit ${rps}/s, ${label} (run ${i + 1})`);
      runs.push(await providerRun({ jobs, rps, rpm, adminUrl: ADMIN_URL, redisUrl: REDIS_URL }));
    }
    const mid = runs.find((r) => r.seconds === median(runs.map((x) => x.seconds)))!;
    const share429 = mid.rateLimited / mid.calls;
    const met = mid.seconds <= goal.time * ideal && share429 <= goal.limited && mid.dead === 0;
    rows.push({
      benchmark: `Goodput under a provider limit of ${rps}/s, ${jobs} jobs, 2 worker processes, ${label}`,
      result: `drained in ${fmt(mid.seconds, 1)} s; ${fmt((jobs / mid.seconds / rps) * 100)}% of the limit used; ` +
        `${mid.rateLimited}/${mid.calls} calls answered 429 (${fmt(share429 * 100, 1)}%); ${mid.dead} dead-lettered`,
      baseline: `ideal ${fmt(ideal, 1)} s (jobs / limit)`,
      ratio: `${fmt(mid.seconds / ideal, 2)}x`,
      goal: `<= ${goal.time}x, <= ${goal.limited * 100}% 429, 0 dead ${met ? "(met)" : "(NOT met)"}`,
      value: mid.seconds,
      baselineValue: ideal,
    });
  };
  await goodput(rps * 60, `LLM_RPM=${rps * 60}`, { time: 1.2, limited: 0.02 });
  await goodput(undefined, "limits learned from headers", { time: 1.3, limited: 0.1 });
  const outageJobs = 20;
  for (const [outage, ms] of [["quota", smoke ? 2_000 : 12_000], ["503", smoke ? 2_000 : 15_000]] as const) {
    const cooldownS = smoke ? 0.5 : 3;
    progress(`provider: ${outageJobs} jobs through a ${ms / 1000} s ${outage} outage, cooldown ${cooldownS} s`);
    const r = await providerRun({
      jobs: outageJobs,
      rps,
      rpm: rps * 60,
      outage,
      outageMs: ms,
      cooldownS,
      adminUrl: ADMIN_URL,
      redisUrl: REDIS_URL,
    });
    const met = r.dead === 0 && r.afterRecovery <= 10;
    rows.push({
      benchmark:
        `${ms / 1000} s ${outage === "quota" ? "insufficient_quota" : "503"} outage, ${outageJobs} queued jobs, ` +
        `LLM_BREAKER_COOLDOWN_S=${cooldownS}`,
      result:
        `${r.failedDuringOutage} calls during the outage; all done ${fmt(r.afterRecovery, 1)} s after recovery; ` +
        `${r.dead} dead-lettered`,
      baseline: `before flow control: every job dead-lettered`,
      goal: `0 dead, done <= 10 s after recovery ${met ? "(met)" : "(NOT met)"}`,
      value: r.afterRecovery,
    });
  }
}

/**
 * Issue 40's rows (`deployments_bench.ts`): two deployments of one model by weight at their limits (drain against
 * the ideal, the split, 429s), the same weights at equal limits (neither pushed past its limit), and a short 429
 * pause of a model's only deployment under runs of a task that lists a fallback model (the share that fell back).
 */
async function benchDeployments() {
  const rounds = async (
    label: string,
    options: Omit<Parameters<typeof deploymentsRun>[0], "adminUrl" | "redisUrl">,
  ) => {
    const runs: DeploymentsRun[] = [];
    for (let i = 0; i < RUNS; i++) {
      progress(`deployments: ${label} (run ${i + 1})`);
      const run = await deploymentsRun({ ...options, adminUrl: ADMIN_URL, redisUrl: REDIS_URL });
      progress(
        `deployments: ${fmt(run.seconds, 1)} s; served ${JSON.stringify(run.served)}; ` +
          `servers ${JSON.stringify(run.servers)}; ${run.dead} dead`,
      );
      runs.push(run);
    }
    return runs;
  };
  const calls = (r: DeploymentsRun) => Object.values(r.servers).reduce((sum, s) => sum + s.calls, 0);
  const limited = (r: DeploymentsRun) => Object.values(r.servers).reduce((sum, s) => sum + s.rateLimited, 0);
  const servedBy = (r: DeploymentsRun, name: string) => r.served[name] ?? 0;
  const ofRuns = RUNS > 1 ? ` (medians of ${RUNS}; worst run where it says so)` : "";

  // Two deployments of one model by weight, as the issue sets them: 400 runs at 15 + 5 req/s, ideal 20 s.
  const byWeight = async (limits: [number, number], jobs: number) => {
    const deployments: BenchDeployment[] = [
      { name: "a", models: ["gpt-4.1-mini"], weight: 3, rps: limits[0] },
      { name: "b", models: ["gpt-4.1-mini"], weight: 1, rps: limits[1] },
    ];
    const ideal = jobs / (limits[0] + limits[1]);
    const label = `weights 3 and 1, limits ${limits[0]} and ${limits[1]} req/s, ${jobs} runs`;
    const runs = await rounds(label, { deployments, jobs });
    const seconds = median(runs.map((r) => r.seconds));
    const shareA = median(runs.map((r) => servedBy(r, "a") / (servedBy(r, "a") + servedBy(r, "b"))));
    const share429 = median(runs.map((r) => limited(r) / calls(r)));
    const worst429 = Math.max(...runs.map((r) => limited(r) / calls(r)));
    const dead = Math.max(...runs.map((r) => r.dead));
    return { runs, ideal, seconds, shareA, share429, worst429, dead, label };
  };
  const setting = `2 worker processes at WORKER_CONCURRENCY=32, limits learned from each server's headers`;

  {
    const limits: [number, number] = smoke ? [30, 10] : [15, 5];
    const r = await byWeight(limits, smoke ? 80 : 400);
    const ratioAB = r.shareA / (1 - r.shareA);
    // "Within 10% of 3:1": a's share within 10% of 75% (67.5% to 82.5%).
    const splitMet = Math.abs(r.shareA - 0.75) <= 0.075;
    const met = r.seconds <= 1.15 * r.ideal && splitMet && r.share429 <= 0.02 && r.dead === 0;
    rows.push({
      benchmark: `Two deployments of one model, ${r.label}, ${setting}`,
      result: `drained in ${fmt(r.seconds, 1)} s; split ${fmt(r.shareA * 100, 1)}% : ${
        fmt((1 - r.shareA) * 100, 1)
      }% (${fmt(ratioAB, 2)}:1); 429s ${fmt(r.share429 * 100, 1)}% of calls (worst ${
        fmt(r.worst429 * 100, 1)
      }%); ${r.dead} dead-lettered${ofRuns}`,
      baseline: `ideal ${fmt(r.ideal, 1)} s (runs / ${limits[0] + limits[1]} req/s)`,
      ratio: `${fmt(r.seconds / r.ideal, 2)}x`,
      goal: `<= 1.15x, split within 10% of 3:1 (a 67.5-82.5%), <= 2% 429, 0 dead ${met ? "(met)" : "(NOT met)"}`,
      value: r.seconds,
      baselineValue: r.ideal,
    });
  }
  {
    const limits: [number, number] = smoke ? [20, 20] : [10, 10];
    const r = await byWeight(limits, smoke ? 80 : 400);
    const most = (name: string) => Math.max(...r.runs.map((x) => x.servers[name]!.maxPerSecond));
    const limitedOf = (name: string) => Math.max(...r.runs.map((x) => x.servers[name]!.rateLimited));
    // How close the provider came to limit + 1 in a second: the shortest span of limit + 1 arrivals, over 1,000 ms.
    const headroom = (name: string) => Math.min(...r.runs.map((x) => x.servers[name]!.tightestMs)) - 1_000;
    const pushed = limitedOf("a") + limitedOf("b") > 0 || most("a") > limits[0] || most("b") > limits[1];
    const met = !pushed && r.seconds <= 1.15 * r.ideal && r.dead === 0;
    rows.push({
      benchmark: `Two deployments of one model, ${r.label}: neither pushed past its limit, ${setting}`,
      result: `drained in ${fmt(r.seconds, 1)} s; split ${fmt(r.shareA * 100, 1)}% : ${
        fmt((1 - r.shareA) * 100, 1)
      }%; 429s a ${limitedOf("a")}, b ${limitedOf("b")} (worst run); most requests in any sliding second a ${
        most("a")
      }, b ${most("b")} (worst run); headroom a ${headroom("a")} ms, b ${headroom("b")} ms (the shortest span of ${
        limits[0] + 1
      } arrivals less 1 s, worst run); ${r.dead} dead-lettered${ofRuns}`,
      baseline: `ideal ${fmt(r.ideal, 1)} s (runs / ${limits[0] + limits[1]} req/s)`,
      ratio: `${fmt(r.seconds / r.ideal, 2)}x`,
      goal: `0 429s, <= ${limits[0]} per second each, <= 1.15x, 0 dead ${met ? "(met)" : "(NOT met)"}`,
      value: r.seconds,
      baselineValue: r.ideal,
    });
  }
  {
    const rps = 20;
    const jobs = smoke ? 60 : 200;
    const pause = { deployment: "p", atMs: smoke ? 1_000 : 3_000, ms: 2_000 };
    const deployments: BenchDeployment[] = [
      { name: "p", models: ["primary"], weight: 1, rps },
      { name: "f", models: ["fallback"], weight: 1, rps },
    ];
    const runs = await rounds(
      `${jobs} runs of a task listing primary then fallback, a ${pause.ms / 1000} s 429 pause of primary's only ` +
        `deployment ${pause.atMs / 1000} s in`,
      { deployments, jobs, fallbackTask: ["primary", "fallback"], pause },
    );
    const fellBack = (r: DeploymentsRun) => r.servers.f!.calls;
    const seconds = median(runs.map((r) => r.seconds));
    const ideal = jobs / rps + pause.ms / 1000;
    const share = median(runs.map((r) => fellBack(r) / r.jobs));
    const worst = Math.max(...runs.map(fellBack));
    const pauseAnswers = median(runs.map((r) => r.servers.p!.rateLimited));
    const dead = Math.max(...runs.map((r) => r.dead));
    const met = worst === 0 && dead === 0;
    rows.push({
      benchmark: `A ${pause.ms / 1000} s 429 rate_limit_exceeded pause of a model's only deployment (limit ${rps} ` +
        `req/s), ${jobs} runs of a task listing a fallback model (LLM_FALLBACK_AFTER_S=10), ${setting}`,
      result: `${fmt(share * 100, 1)}% of calls fell back (worst run ${worst}); 429 answers ${fmt(pauseAnswers)}; ` +
        `drained in ${fmt(seconds, 1)} s; ${dead} dead-lettered${ofRuns}`,
      baseline: `ideal ${fmt(ideal, 1)} s (runs / ${rps} req/s + the pause)`,
      ratio: `${fmt(seconds / ideal, 2)}x`,
      goal: `0 fell back, 0 dead ${met ? "(met)" : "(NOT met)"}`,
      value: share,
    });
  }
}

/**
 * `Prefer: wait`: the real API and worker processes, the real SDK over HTTP
 * to a model that answers in 300 ms. What the client waits beyond the model's
 * answer (commit, NOTIFY, wake-up, the answer) against a client polling GET
 * every 100 ms.
 */
async function benchWait() {
  const jobs = smoke ? 5 : 40;
  const modelMs = 300;
  progress(`wait: ${jobs} sequential jobs with Prefer: wait=10, then ${jobs} polled, ${modelMs} ms model`);
  const db = await createScratchDatabase(ADMIN_URL, { prefix: "oncely_bench" });
  const url = await emptyRedisDatabase(REDIS_URL);
  // When the model finished answering each document (the body is small: written at once).
  const answeredAt = new Map<string, number>();
  const model = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen() {} }, async (req) => {
    const body = await req.json() as { messages: { content: string }[] };
    const prompt = body.messages.at(-1)!.content;
    await sleep(modelMs);
    const id = /Wait bench (\d+)/.exec(prompt)?.[0] ?? "";
    queueMicrotask(() => answeredAt.set(id, performance.now()));
    return Response.json(completionBody("Revenue rose."));
  });
  const apiPort = freePort();
  const env = {
    DATABASE_URL: db.url,
    REDIS_URL: url,
    PORT: String(apiPort),
    OPENAI_API_KEY: "sk-bench",
    OPENAI_BASE_URL: `http://127.0.0.1:${model.addr.port}/v1`,
    LOG_LEVEL: "warn",
  };
  const key = await createApiKey(db.sql, "bench");
  const api = await startServiceProcess("api", { ...env, LOG_LEVEL: "info" }, "api_listening");
  const worker = await startWorkerProcess({ ...env, LOG_LEVEL: "info" });
  const post = (i: number, prefer?: string) =>
    fetch(`http://127.0.0.1:${apiPort}/v1/summaries`, {
      method: "POST",
      headers: {
        authorization: `Bearer ${key}`,
        "content-type": "application/json",
        "idempotency-key": `wait-bench-${crypto.randomUUID()}`,
        ...(prefer ? { prefer } : {}),
      },
      body: JSON.stringify({ text: `Wait bench ${i}. Revenue rose. Costs fell.`, notify: "ops@example.com" }),
    });
  try {
    const waited: number[] = [];
    for (let i = 0; i < jobs; i++) {
      const res = await post(i, "wait=10");
      const t = performance.now();
      if (res.status !== 200) throw new Error(`wait: POST answered ${res.status}, not 200`);
      await res.body?.cancel();
      waited.push(t - answeredAt.get(`Wait bench ${i}`)!);
    }
    const polled: number[] = [];
    for (let i = jobs; i < 2 * jobs; i++) {
      const { job_id } = await (await post(i)).json();
      // A random phase, as real clients have: without it every poll lands just after the 300 ms model.
      await sleep(Math.random() * 100);
      for (;;) {
        await sleep(100);
        const doc = await (await fetch(`http://127.0.0.1:${apiPort}/v1/summaries/${job_id}`, {
          headers: { authorization: `Bearer ${key}` },
        })).json();
        if (doc.status === "done") break;
      }
      polled.push(performance.now() - answeredAt.get(`Wait bench ${i}`)!);
    }
    const p50 = quantile(waited, 0.5), p99 = quantile(waited, 0.99), polledP50 = quantile(polled, 0.5);
    rows.push({
      benchmark: `Prefer: wait=10, real API and worker processes, ${modelMs} ms model: ` +
        "from the model's answer to the client's 200",
      result: `p50 ${fmt(p50, 1)} ms, p99 ${fmt(p99, 1)} ms`,
      baseline: `polling GET every 100 ms: p50 ${fmt(polledP50, 1)} ms`,
      ratio: `${fmt(p50 / polledP50, 2)}x`,
      goal: `< 50 ms ${p99 < 50 ? "(met)" : "(NOT met)"}`,
      value: p50,
      baselineValue: polledP50,
    });
  } finally {
    await worker.stop();
    await api.stop();
    await model.shutdown();
    // Give the database index back: the bench and the tests share Redis's sixteen.
    await releaseRedisDatabase(url).catch(() => {});
    await db.close();
  }
}

/** Tenant `i` (from 1) of the lanes-scale rows: their lanes, their API keys and wrk's `X-Tenant-Id`. */
const LANE_TENANT_PREFIX = "lane-";
const laneTenant = (i: number) => `${LANE_TENANT_PREFIX}${i}`;
/** Issue 39's tenant counts (the first is the baseline), and the backlog each drains: the same at every count. */
const LANE_COUNTS = smoke ? [1, 100, 1_000] : [1, 100, 5_000, 20_000];
const LANE_JOBS = smoke ? 2_000 : 20_000;
/** Issue 39's document: a text of 110 bytes. */
const LANES_REQUEST: SummaryRequest = {
  text:
    "Revenue rose 12% in Q3. Costs fell. The board approved the expansion plan for next year. Hiring resumes in Q1.",
  notify: "ops@example.com",
};
const LANES_GATEWAY_SECRET = "bench-gateway-secret-0123456789";
/** `list` rotated left by `i`, so each round starts with another entry. */
function rotated<T>(list: readonly T[], i: number): T[] {
  const at = i % list.length;
  return [...list.slice(at), ...list.slice(0, at)];
}

/**
 * Queues `jobs` summary jobs of `request` round robin over tenants 1 to `tenants` with the enqueue script of the
 * tests (stream entry and status record, as intake writes them), pipelined, announcing no lane.
 */
async function queueSpread(
  redis: Redis,
  keys: ServiceKeys,
  jobs: number,
  { tenants, request }: { tenants: number; request: SummaryRequest },
) {
  for (let start = 0; start < jobs; start += 5_000) {
    await Promise.all(Array.from({ length: Math.min(5_000, jobs - start) }, (_, k) => {
      const tenant = laneTenant(((start + k) % tenants) + 1);
      return enqueueJob(redis, keys.lane(tenant), { jobId: crypto.randomUUID(), tenant, request });
    }));
  }
}

/**
 * A newcomer behind a backlog: 1 s after the call, queues and announces one job of a tenant with nothing queued
 * (as intake does), then polls `job_outcomes` every 10 ms. @returns the seconds from its queueing to its outcome.
 */
async function newcomerDecidedS(redis: Redis, sql: Sql, keys: ServiceKeys, request: SummaryRequest): Promise<number> {
  await sleep(1_000);
  const jobId = crypto.randomUUID();
  const queued = performance.now();
  await enqueueToLane(redis, keys, { jobId, tenant: "newcomer", request });
  for (const end = queued + 120_000; performance.now() < end; await sleep(10)) {
    const [row] = await sql`SELECT 1 FROM job_outcomes WHERE job_id = ${jobId}`;
    if (row) return (performance.now() - queued) / 1000;
  }
  throw new Error("lanes scale: the newcomer's job was not decided in 120 s");
}

/**
 * Announces the lanes of `tenants` at once: both registry sets in one MULTI, then one wake-up, so a backlog over
 * thousands of lanes appears in one instant (an announce per lane would wake the worker once per lane).
 */
async function announceAll(redis: Redis, keys: ServiceKeys, tenants: string[]) {
  const { active, all, wake } = keys.registry;
  await redis.multi().sadd(active, ...tenants).sadd(all, ...tenants).publish(wake, tenants[0]!).exec();
}

/** Tenants 1 to `count` ({@linkcode laneTenant}), each with an API key, as `deno task tenant create` makes them. */
async function createLaneTenants(sql: Sql, count: number) {
  for (let start = 1; start <= count; start += 200) {
    await Promise.all(
      Array.from({ length: Math.min(200, count - start + 1) }, (_, k) => createApiKey(sql, laneTenant(start + k))),
    );
  }
}

/** Issue 39's goal at `tenants` tenants: none for the baseline, and said to start at `from` tenants below that. */
function laneGoal(tenants: number, from: number, goal: string, met: boolean): string {
  if (tenants === 1) return "";
  if (tenants < from) return `none here (issue 39: ${goal} from ${fmt(from)} tenants)`;
  return `${goal} ${met ? "(met)" : "(NOT met)"}`;
}

/**
 * Drain by tenant count: the real worker process (as in the worker-process rows, instant model, concurrency 256)
 * over the same backlog spread over 1 to 20,000 tenants, each run on a fresh database and Redis database, the order
 * of the counts rotating between rounds; the baseline is one tenant in the same rounds.
 */
async function benchLanesDrain() {
  const model = await startModelProcess(0);
  try {
    const runs = new Map<
      number,
      { perSecond: number; newcomerS?: number; cpuMsPerJob: number; redisCpuMsPerJob: number }[]
    >();
    for (let i = 0; i < RUNS; i++) {
      for (const tenants of rotated(LANE_COUNTS, i)) {
        progress(
          `lanes scale: drain of ${fmt(LANE_JOBS)} jobs over ${fmt(tenants)} tenant(s), real worker process, ` +
            `instant model (round ${i + 1})`,
        );
        // At the largest count, a newcomer's first job behind the whole backlog (issue 39: within 1 s).
        const newcomer = tenants === LANE_COUNTS.at(-1);
        const run = await workerProcessRun(model, LANE_JOBS, undefined, {
          lanes: { tenants, request: LANES_REQUEST, newcomer },
        });
        progress(
          `lanes scale: ${fmt(tenants)} tenant(s): ${fmt(run.perSecond)} jobs/s, worker CPU ` +
            `${fmt(run.cpuMsPerJob, 2)} ms/job, Redis CPU ${fmt(run.redisCpuMsPerJob, 2)} ms/job` +
            (run.newcomerS === undefined ? "" : `; a newcomer's job decided ${fmt(run.newcomerS, 2)} s after queueing`),
        );
        runs.set(tenants, [...runs.get(tenants) ?? [], run]);
      }
    }
    const of = (tenants: number) => {
      const list = runs.get(tenants)!;
      return {
        rate: median(list.map((x) => x.perSecond)),
        cpu: median(list.map((x) => x.cpuMsPerJob)),
        redisCpu: median(list.map((x) => x.redisCpuMsPerJob)),
        newcomer: list.some((x) => x.newcomerS !== undefined) ? median(list.map((x) => x.newcomerS ?? NaN)) : undefined,
      };
    };
    const one = of(1);
    const cpuText = (x: typeof one) => `CPU ${fmt(x.cpu, 2)} ms/job worker, ${fmt(x.redisCpu, 2)} ms/job Redis`;
    for (const tenants of LANE_COUNTS) {
      const x = of(tenants);
      const ratio = x.rate / one.rate;
      rows.push({
        benchmark: `Lanes: drain of ${fmt(LANE_JOBS)} queued jobs over ${fmt(tenants)} tenant(s) ` +
          `(${fmt(LANE_JOBS / tenants)} each), real worker process, openai SDK over HTTP, instant model, ` +
          "WORKER_CONCURRENCY=256",
        result: `${fmt(x.rate)}/s; ${cpuText(x)}`,
        baseline: tenants === 1
          ? "the baseline of the drain rows below"
          : `1 tenant, same rounds: ${fmt(one.rate)}/s; ${cpuText(one)}`,
        ratio: `${fmt(ratio, 2)}x`,
        goal: laneGoal(tenants, 5_000, ">= 0.8x", ratio >= 0.8),
        value: x.rate,
        baselineValue: one.rate,
      });
    }
    const most = of(LANE_COUNTS.at(-1)!);
    if (most.newcomer !== undefined) {
      rows.push({
        benchmark: `Lanes: fairness at ${fmt(LANE_COUNTS.at(-1)!)} tenants: one job of a new tenant queued 1 s into ` +
          "the drain above, behind the whole backlog, real worker process",
        result: `decided ${fmt(most.newcomer, 2)} s after queueing (median)`,
        goal: `<= 1 s ${most.newcomer <= 1 ? "(met)" : "(NOT met)"}`,
        value: most.newcomer,
      });
    }
    await benchBacklogDrain(model);
  } finally {
    await model.stop();
  }
}

/** One tenant, a small backlog against a large one (issue 39: 150,000 queued drains >= 0.9x as fast as 6,000). */
async function benchBacklogDrain(model: { url: string; pid: number }) {
  const sizes = smoke ? [600, 6_000] : [6_000, 150_000];
  const runs = new Map<number, number[]>();
  for (let i = 0; i < RUNS; i++) {
    for (const jobs of rotated(sizes, i)) {
      progress(`lanes scale: drain of ${fmt(jobs)} jobs queued by one tenant (round ${i + 1})`);
      const run = await workerProcessRun(model, jobs, undefined, { lanes: { tenants: 1, request: LANES_REQUEST } });
      progress(`lanes scale: ${fmt(jobs)} queued: ${fmt(run.perSecond)} jobs/s`);
      runs.set(jobs, [...runs.get(jobs) ?? [], run.perSecond]);
    }
  }
  const [small, large] = sizes.map((jobs) => median(runs.get(jobs)!)) as [number, number];
  const ratio = large / small;
  rows.push({
    benchmark: `Lanes: drain of ${fmt(sizes[1]!)} jobs queued by one tenant, real worker process, instant model`,
    result: `${fmt(large)}/s`,
    baseline: `${fmt(sizes[0]!)} queued, same rounds: ${fmt(small)}/s`,
    ratio: `${fmt(ratio, 2)}x`,
    goal: `>= 0.9x ${ratio >= 0.9 ? "(met)" : "(NOT met)"}`,
    value: large,
    baselineValue: small,
  });
}

/**
 * One POST for each of `tenants` tenants to an API of the lanes-intake bench, 64 at a time (not measured): to warm
 * its caches, and before each load to put every tenant's lane in place.
 */
async function postOncePerTenant(port: number, tenants: number, runId: string, why = "warming its caches") {
  progress(`lanes scale: one POST per tenant to the API for ${fmt(tenants)} tenant(s) (${why})`);
  let next = 1;
  await Promise.all(Array.from({ length: 64 }, async () => {
    for (let i = next++; i <= tenants; i = next++) {
      const res = await fetch(`http://127.0.0.1:${port}${SUMMARIES}`, {
        method: "POST",
        headers: {
          "content-type": "application/json",
          "x-gateway-secret": LANES_GATEWAY_SECRET,
          "x-tenant-id": laneTenant(i),
          "idempotency-key": `lanes-warm-${tenants}-${runId}-${i}`,
        },
        body: JSON.stringify(LANES_REQUEST),
      });
      await res.body?.cancel();
      if (res.status !== 202) throw new Error(`lanes intake warm-up: ${laneTenant(i)} answered ${res.status}`);
    }
  }));
}

/**
 * Intake by tenant count: one real API per count (`deno task api`, AUTH_MODE=trusted-header, so the tenants need
 * no keys in the requests), side by side on one database of tenants and one Redis database, each loaded in turn
 * by wrk with `X-Tenant-Id` drawn at random per POST from its count's tenants, the order rotating. Each API has had
 * one POST from each of its tenants first, as a service has from the tenants it serves. Before each load Redis is
 * emptied and every tenant of the count posts one job (not measured), so each tenant's lane is in place as a
 * tenant in use has it (its streams, its period's records hash, its place in the registry), each lane holding one
 * queued job (so the backlog walk of `/metrics` reads every lane, as it does a service's lanes with work); then 2 s
 * for the API to settle after that burst. The largest count is
 * also loaded as new tenants, each load from an empty Redis database (every tenant's first POST makes its lane),
 * against one tenant likewise. The baseline is one tenant in the same rounds.
 */
async function benchLanesIntake() {
  const db = await createScratchDatabase(ADMIN_URL, { prefix: "oncely_bench" });
  const redisUrl = await emptyRedisDatabase(REDIS_URL);
  const redis = new Redis(redisUrl, { maxRetriesPerRequest: 1 });
  const seconds = smoke ? 1 : 5;
  const runId = crypto.randomUUID().slice(0, 8);
  const servers = new Map<number, { port: number; cpuMs(): Promise<number>; stop(): Promise<void> }>();
  /** A load of `tenants`: with their lanes in place (`inUse`), or from an empty Redis database (new tenants). */
  const load = async (tenants: number, seconds: number, tag: string, inUse = true) => {
    const server = servers.get(tenants)!;
    await redis.flushdb();
    if (inUse) {
      await postOncePerTenant(server.port, tenants, `${runId}-${tag}`, "its lanes in place");
      await new Promise((resolve) => setTimeout(resolve, 2_000));
    }
    const before = await server.cpuMs();
    const redisBefore = await redisCpuMs(redis);
    const result = await postLoad({
      url: `http://127.0.0.1:${server.port}${SUMMARIES}`,
      headers: { "content-type": "application/json", "x-gateway-secret": LANES_GATEWAY_SECRET },
      body: JSON.stringify(LANES_REQUEST),
      vary: { header: "idempotency-key", prefix: `lanes-${tenants}-${runId}-${tag}-${inUse ? "u" : "n"}-` },
      spread: { header: "x-tenant-id", prefix: LANE_TENANT_PREFIX, count: tenants },
      connections: 64,
      seconds,
      expectStatus: 202,
    }, progress);
    const cpuUs = ((await server.cpuMs()) - before) * 1000 / (result.perSecond * seconds);
    const redisCpuUs = ((await redisCpuMs(redis)) - redisBefore) * 1000 / (result.perSecond * seconds);
    if (result.errors > 0) {
      throw new Error(`lanes intake, ${tenants} tenant(s): ${result.errors} POSTs not answered 202`);
    }
    progress(
      `lanes scale: intake over ${fmt(tenants)} ${inUse ? "tenant(s)" : "new tenant(s)"}: ${
        fmt(result.perSecond)
      }/s, ` +
        `p99 ${fmt(result.p99, 1)} ms, ` +
        `${fmt(cpuUs)} µs CPU/req, Redis ${fmt(redisCpuUs, 1)} µs/req`,
    );
    return { ...result, cpuUs, redisCpuUs };
  };
  try {
    progress(`lanes scale: ${fmt(LANE_COUNTS.at(-1)!)} tenants with a key each (trusted-header serves only those)`);
    await createLaneTenants(db.sql, LANE_COUNTS.at(-1)!);
    for (const tenants of LANE_COUNTS) {
      progress(`lanes scale: starting the API for ${fmt(tenants)} tenant(s)`);
      const port = freePort();
      const api = await startApi({
        DATABASE_URL: db.url,
        REDIS_URL: redisUrl,
        PORT: String(port),
        LOG_LEVEL: "info",
        AUTH_MODE: "trusted-header",
        GATEWAY_SECRET: LANES_GATEWAY_SECRET,
      });
      servers.set(tenants, { port, cpuMs: api.cpuMs, stop: api.stop });
    }
    // Every tenant in use, as a service's are: one POST each first, so each API holds every tenant's cached rows
    // and lane head (a draw at random per POST first meets some of 20,000 tenants only in the rounds measured).
    for (const tenants of LANE_COUNTS) await postOncePerTenant(servers.get(tenants)!.port, tenants, runId);
    // Every API compiled by the JIT before any is measured.
    for (const tenants of LANE_COUNTS) await load(tenants, smoke ? 1 : 3, "warm");
    type Measured = HttpLoad & { cpuUs: number; redisCpuUs: number };
    const results = new Map<number, Measured[]>();
    // New tenants: the largest count and one tenant, each load's lanes made by its own POSTs.
    const largest = LANE_COUNTS.at(-1)!;
    const fresh = new Map<number, Measured[]>();
    for (let i = 0; i < RUNS; i++) {
      for (const tenants of rotated(LANE_COUNTS, i)) {
        progress(`lanes scale: intake over ${fmt(tenants)} tenant(s), ${seconds} s (round ${i + 1})`);
        results.set(tenants, [...results.get(tenants) ?? [], await load(tenants, seconds, String(i))]);
      }
      for (const tenants of i % 2 === 0 ? [1, largest] : [largest, 1]) {
        progress(`lanes scale: intake over ${fmt(tenants)} new tenant(s), ${seconds} s (round ${i + 1})`);
        fresh.set(tenants, [...fresh.get(tenants) ?? [], await load(tenants, seconds, String(i), false)]);
      }
    }
    await redis.flushdb();
    const one = medianRun(results.get(1)!);
    const cpu = (tenants: number) =>
      `API CPU ${fmt(median(results.get(tenants)!.map((x) => x.cpuUs)))} µs/request, Redis ${
        fmt(median(results.get(tenants)!.map((x) => x.redisCpuUs)), 1)
      }`;
    const latency = (x: ReturnType<typeof medianRun>) => `p50 ${fmt(x.p50, 1)} ms, p99 ${fmt(x.p99, 1)} ms`;
    const by = generatorLabel(results.get(1)![0]!.generator);
    for (const tenants of LANE_COUNTS) {
      const x = medianRun(results.get(tenants)!);
      const ratio = x.rps / one.rps;
      rows.push({
        benchmark: `Lanes: intake POST ${SUMMARIES} per s over ${fmt(tenants)} tenant(s) in use (each lane in place ` +
          `with one queued job; X-Tenant-Id at random per POST), real API (deno task api, ` +
          `AUTH_MODE=trusted-header), one process, ${INGEST_LOAD}, ${by}`,
        result: `${fmt(x.rps)}/s (${latency(x)}); ${cpu(tenants)}`,
        baseline: tenants === 1
          ? "the baseline of the intake rows below"
          : `1 tenant, same rounds: ${fmt(one.rps)}/s (${latency(one)}); ${cpu(1)}`,
        ratio: `${fmt(ratio, 2)}x`,
        goal: laneGoal(tenants, 20_000, ">= 0.9x, p99 <= 30 ms", ratio >= 0.9 && x.p99 <= 30),
        value: x.rps,
        baselineValue: one.rps,
      });
    }
    const newOne = medianRun(fresh.get(1)!);
    const newMany = medianRun(fresh.get(largest)!);
    const freshCpu = (tenants: number) =>
      `API CPU ${fmt(median(fresh.get(tenants)!.map((x) => x.cpuUs)))} µs/request, Redis ${
        fmt(median(fresh.get(tenants)!.map((x) => x.redisCpuUs)), 1)
      }`;
    rows.push({
      benchmark: `Lanes: intake POST ${SUMMARIES} per s over ${fmt(largest)} new tenants (each load from an empty ` +
        `Redis database: every tenant's first POST makes its lane), as above`,
      result: `${fmt(newMany.rps)}/s (${latency(newMany)}); ${freshCpu(largest)}`,
      baseline: `1 new tenant, same rounds: ${fmt(newOne.rps)}/s (${latency(newOne)}); ${freshCpu(1)}`,
      ratio: `${fmt(newMany.rps / newOne.rps, 2)}x`,
      goal: "none (the goal is for tenants in use, above)",
      value: newMany.rps,
      baselineValue: newOne.rps,
    });
  } finally {
    for (const server of servers.values()) await server.stop();
    await redis.quit().catch(() => redis.disconnect());
    await releaseRedisDatabase(redisUrl).catch(() => {});
    await db.close();
  }
}

/** Redis's `used_memory`, in bytes: the whole server's. */
async function usedMemory(redis: Redis): Promise<number> {
  return Number(/^used_memory:(\d+)/m.exec(await redis.info("memory"))?.[1] ?? NaN);
}

/** The sum of `MEMORY USAGE` (exact: `SAMPLES 0`) over every key of the client's database, in bytes. */
async function keysMemory(redis: Redis): Promise<number> {
  let total = 0;
  let cursor = "0";
  do {
    const [next, keys] = await redis.scan(cursor, "COUNT", 1000);
    cursor = next;
    const sizes = await Promise.all(keys.map((key) => redis.memory("USAGE", key, "SAMPLES", 0)));
    for (const size of sizes) total += Number(size ?? 0);
  } while (cursor !== "0");
  return total;
}

/**
 * Redis bytes per queued job: `jobs` summary jobs of issue 39's document through the service's intake (its script:
 * the stream entry, the status record and the idempotency record in its lane's hash of records, batched as the API
 * batches them), round robin over `tenants` tenants, into an empty Redis database with no worker. Measured as the
 * growth of `used_memory` (the whole server's: meaningful while nothing else writes to it) and of the keys' own
 * `MEMORY USAGE`, after one job of another tenant has loaded the script and made the registry's sets, with the
 * writing connection closed (its buffers freed) before each reading.
 */
async function queuedBytes(jobs: number, tenants: number): Promise<{ used: number; keys: number }> {
  const url = await emptyRedisDatabase(REDIS_URL);
  const probe = new Redis(url, { maxRetriesPerRequest: 1 });
  const submit = async (count: number, tenantOf: (i: number) => string) => {
    const writer = new Redis(url, { maxRetriesPerRequest: 1 });
    try {
      const intake = createIntake({ redis: writer }, {
        keys: serviceKeys(KEY_PREFIX),
        resultTtlS: 86_400,
        path: SUMMARIES,
      });
      const forms = summaryForms(LANES_REQUEST);
      for (let start = 0; start < count; start += 5_000) {
        await Promise.all(Array.from({ length: Math.min(5_000, count - start) }, (_, k) =>
          intake.submit({
            scope: { tenant: tenantOf(start + k), method: "POST", path: SUMMARIES, key: crypto.randomUUID() },
            request: LANES_REQUEST,
            ...forms,
          })));
      }
    } finally {
      await writer.quit();
    }
    await sleep(100);
  };
  try {
    await submit(1, () => "warm-up");
    const [usedBefore, keysBefore] = [await usedMemory(probe), await keysMemory(probe)];
    await submit(jobs, (i) => laneTenant((i % tenants) + 1));
    const [usedAfter, keysAfter] = [await usedMemory(probe), await keysMemory(probe)];
    return { used: (usedAfter - usedBefore) / jobs, keys: (keysAfter - keysBefore) / jobs };
  } finally {
    await probe.quit().catch(() => probe.disconnect());
    await releaseRedisDatabase(url).catch(() => {});
  }
}

/** Issue 39's backlog for Redis bytes per queued job at one tenant: 150,000 (the smoke run keeps a small one). */
const BYTES_JOBS = smoke ? LANE_JOBS : 150_000;

/**
 * Redis bytes per queued job: {@linkcode BYTES_JOBS} at one tenant (issue 39's goal), and the lanes rows' backlog
 * at the most tenants (one job each at 20,000), against the payload alone.
 */
async function benchLanesBytes() {
  const most = LANE_COUNTS.at(-1)!;
  const jobsAt = (tenants: number) => tenants === 1 ? BYTES_JOBS : LANE_JOBS;
  const measured = new Map<number, { used: number; keys: number }[]>();
  for (let i = 0; i < RUNS; i++) {
    for (const tenants of rotated([1, most], i)) {
      progress(
        `lanes scale: Redis bytes per queued job, ${fmt(jobsAt(tenants))} jobs through the intake over ` +
          `${fmt(tenants)} tenant(s) (round ${i + 1})`,
      );
      const x = await queuedBytes(jobsAt(tenants), tenants);
      progress(`lanes scale: ${fmt(x.used)} bytes/job (used_memory), ${fmt(x.keys)} bytes/job (MEMORY USAGE)`);
      measured.set(tenants, [...measured.get(tenants) ?? [], x]);
    }
  }
  const of = (tenants: number) => ({
    used: median(measured.get(tenants)!.map((x) => x.used)),
    keys: median(measured.get(tenants)!.map((x) => x.keys)),
  });
  const one = of(1);
  const payload = new TextEncoder().encode(summaryForms(LANES_REQUEST).payload).length;
  for (const tenants of [1, most]) {
    const x = of(tenants);
    const jobs = jobsAt(tenants);
    rows.push({
      benchmark:
        `Lanes: Redis bytes per queued job, ${fmt(jobs)} jobs of a ${
          new TextEncoder().encode(LANES_REQUEST.text).length
        }-byte document through the service's intake script (stream entry, status record, idempotency record in ` +
        `the lane's hash of records), ${fmt(tenants)} tenant(s), no worker`,
      result: `${fmt(x.used)} bytes/job (INFO used_memory growth / ${fmt(jobs)}); the keys' own MEMORY USAGE ` +
        `${fmt(x.keys)} bytes/job`,
      baseline: tenants === 1
        ? `the stream entry's payload alone: ${payload} bytes`
        : `1 tenant, ${fmt(BYTES_JOBS)} queued, same run: ${fmt(one.used)} bytes/job`,
      ratio: `${fmt(x.used / (tenants === 1 ? payload : one.used), 2)}x`,
      goal: tenants === 1 && jobs === 150_000
        ? `<= 500 bytes ${x.used <= 500 ? "(met)" : "(NOT met)"}`
        : "none here (issue 39: <= 500 bytes with 150,000 queued)",
      value: x.used,
      baselineValue: tenants === 1 ? payload : one.used,
    });
  }
}

/**
 * Issue 39's rows: drain and intake at 1, 100, 5,000 and 20,000 tenants (smoke: 1, 100, 1,000), the same backlog
 * at every count, and Redis bytes per queued job.
 */
async function benchLanesScale() {
  await benchLanesDrain();
  await benchLanesIntake();
  await benchLanesBytes();
}

/** Issue 37's figures: hostile patterns, definitions and PUTs against the real API and worker (`hostile.ts`). */
async function benchHostileSection() {
  rows.push(...await benchHostile({ adminUrl: ADMIN_URL, redisUrl: REDIS_URL, smoke, runs: RUNS, progress }));
}

/** Issue 42's figure: what the OpenAI-compatible door adds to a call (`openai_door.ts`). */
async function benchOpenAiDoorSection() {
  rows.push(...await benchOpenAiDoor({ adminUrl: ADMIN_URL, redisUrl: REDIS_URL, smoke, progress }));
}

const sections: Record<string, () => Promise<void>> = {
  // Memory first: its baseline is then the RSS of a fresh process.
  memory: benchMemory,
  ingest: benchIngest,
  "ingest-runs": benchIngestRuns,
  "ingest-profile": benchIngestProfile,
  worker: benchWorker,
  "worker-process": benchWorkerProcess,
  "worker-process-tasks": benchWorkerProcessTasks,
  "worker-process-budget": benchWorkerProcessBudget,
  queue: benchQueue,
  fairness: benchFairness,
  "token-share": benchTokenShare,
  relay: benchRelay,
  e2e: benchEndToEnd,
  wait: benchWait,
  provider: benchProvider,
  deployments: benchDeployments,
  hostile: benchHostileSection,
  "lanes-scale": benchLanesScale,
  "openai-door": benchOpenAiDoorSection,
};
/** Parts of a section that `--only` may name alone, to measure one of them cheaply; a full run runs them in it. */
const parts: Record<string, () => Promise<void>> = {
  "lanes-drain": benchLanesDrain,
  "lanes-intake": benchLanesIntake,
  "lanes-bytes": benchLanesBytes,
};

const log = createLogger({ level: "warn" });
for (const [name, fn] of Object.entries(only ? { ...sections, ...parts } : sections)) {
  if (only && !only.includes(name)) continue;
  try {
    await fn();
  } catch (error) {
    log.error("bench_section_failed", { section: name, error });
    rows.push({ benchmark: name, result: `FAILED: ${(error as Error).message}`, value: NaN });
  }
}

const cpuinfo = await Deno.readTextFile("/proc/cpuinfo").catch(() => "");
const cpu = cpuinfo.match(/model name\s*:\s*(.+)/)?.[1] ?? cpuinfo.match(/vendor_id\s*:\s*(.+)/)?.[1] ?? "unknown CPU";
console.log(
  `\nOncely bench${
    smoke ? " (smoke)" : ""
  }: ${cpu}, ${navigator.hardwareConcurrency} cores, Deno ${Deno.version.deno}, ` +
    `medians of ${RUNS} run(s)\n`,
);
console.log("| benchmark | result | baseline (same run) | ratio | goal |");
console.log("| --- | --- | --- | --- | --- |");
for (const r of rows) {
  console.log(`| ${r.benchmark} | ${r.result} | ${r.baseline ?? ""} | ${r.ratio ?? ""} | ${r.goal ?? ""} |`);
}
if (jsonFile) {
  await Deno.writeTextFile(jsonFile, JSON.stringify({ smoke, cpu, deno: Deno.version.deno, rows }, null, 2));
  console.error(`[bench] wrote ${jsonFile}`);
}
if (rows.some((r) => r.result.startsWith("FAILED"))) Deno.exit(1);
