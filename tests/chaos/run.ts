/**
 * `deno task chaos`: proves "exactly-once effects under at-least-once
 * delivery" by crashing real processes on purpose.
 *
 * It starts the API, two workers and two relays as subprocesses with the
 * permission sets their tasks derive from this run's configuration, a
 * flaky fake model and a flaky fake Resend, submits jobs the way real
 * clients do (each POST retried 1 to 3 times, some concurrently), SIGKILLs a random
 * process every 1 to 3 s and restarts it, then waits for every accepted job
 * and counts effects. Exits non-zero unless nothing was lost or duplicated.
 *
 *   deno task chaos [--jobs N] [--duration S] [--redis-restart] [--pg-terminate] [--no-kills] [--seed N]
 *                   [--provider-limit RPS] [--cluster]
 *
 * With --cluster, Redis is a local three-master Redis Cluster with AOF on
 * (fsync always) in a temporary directory, REDIS_URL lists its nodes, and one
 * master's process is SIGKILLed and restarted mid-run.
 *
 * With --provider-limit, the fake model also enforces RPS requests in any
 * sliding second with OpenAI's x-ratelimit-* headers and 429 bodies (the
 * workers learn the limit from them), and goes down twice during the kill
 * period: insufficient_quota for 10% of it, then 503 for 10% of it, with a
 * 1 s breaker cooldown.
 *
 * It uses a fresh Postgres database and an empty Redis database index (or,
 * with --redis-restart, its own redis-server with AOF on in a temporary
 * directory), and cleans up afterwards. All traffic stays on 127.0.0.1.
 */
import { Redis } from "ioredis";
import postgres from "postgres";
import { sleep } from "../../src/async/timeout.ts";
import { parseConfig } from "../../src/config.ts";
import type { Command } from "../../src/commands.ts";
import { permissionFlags } from "../../src/permissions.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { SUMMARY_READY_KEY_PREFIX, SUMMARY_WEBHOOK_KEY_PREFIX } from "../../src/summaries/commit.ts";
import { ensureWebhookSecret } from "../../src/tenants/webhook_secrets.ts";
import { startFakeWebhookReceiver } from "../support/fake_webhook_receiver.ts";
import { KEY_PREFIX, serviceKeys } from "../../src/summaries/keys.ts";
import { allLanes } from "../../src/summaries/all_lanes.ts";
import { startFakeMail } from "../support/fake_mail_server.ts";
import { limitedProvider, startFakeModel } from "../support/fake_model_server.ts";
import { createScratchDatabase, emptyRedisDatabase } from "../support/scratch.ts";
import { type LocalCluster, startLocalCluster } from "../support/redis_cluster.ts";
import { connectRedis, type RedisClient } from "../../src/clients.ts";
import { freePort } from "../support/free_port.ts";
import { seededRandom } from "../support/random.ts";

const args = Deno.args;
const flag = (name: string) => args.includes(`--${name}`);
const option = (name: string, fallback: number) => {
  const i = args.indexOf(`--${name}`);
  const value = i >= 0 ? Number(args[i + 1]) : fallback;
  if (!Number.isFinite(value) || value < 0) {
    console.error(`--${name} must be a number (got ${JSON.stringify(args[i + 1])})`);
    Deno.exit(2);
  }
  return value;
};
const JOBS = option("jobs", 500);
const DURATION_S = option("duration", 30);
const DRAIN_TIMEOUT_S = option("drain-timeout", 180);
const REDIS_RESTART = flag("redis-restart");
const CLUSTER = flag("cluster");
const PG_TERMINATE = flag("pg-terminate");
const NO_KILLS = flag("no-kills");
const PROVIDER_LIMIT = option("provider-limit", 0);
const SEED = option("seed", Date.now() % 1_000_000);
const random = seededRandom(SEED);
const pick = <T>(items: T[]) => items[Math.floor(random() * items.length)]!;

const ADMIN_URL = Deno.env.get("CHAOS_DATABASE_URL") ?? "postgres://postgres@127.0.0.1:5432/postgres";
const logDir = await Deno.makeTempDir({ prefix: "oncely-chaos-" });
const stderr = (line: string) => Deno.stderr.writeSync(new TextEncoder().encode(line));

// ---------------------------------------------------------------- providers
let modelCalls = 0;
const limited = PROVIDER_LIMIT > 0 ? limitedProvider({ rps: PROVIDER_LIMIT }) : undefined;
const model = startFakeModel((n, prompt) => {
  modelCalls++;
  const gate = limited?.respond(n, prompt);
  if (gate && gate.kind !== "ok") return gate;
  const r = random();
  if (r < 0.08) return { kind: "status", status: 429, headers: { "retry-after": "0.2" } };
  if (r < 0.14) return { kind: "status", status: 503 };
  if (r < 0.17) return { kind: "hang" };
  return {
    kind: "ok",
    delayMs: 5 + Math.floor(random() * 30),
    headers: gate?.kind === "ok" ? gate.headers : undefined,
  };
});
const mail = startFakeMail(() => (random() < 0.1 ? { kind: "status", status: 500 } : { kind: "ok" }));

// ---------------------------------------------------------------- Redis and Postgres
const db = await createScratchDatabase(ADMIN_URL, { prefix: "oncely_chaos" });
let redisUrl: string;
let ownRedis: { port: number; dir: string; child?: Deno.ChildProcess } | undefined;

async function startOwnRedis() {
  ownRedis!.child = new Deno.Command("redis-server", {
    args: [
      "--port",
      String(ownRedis!.port),
      "--bind",
      "127.0.0.1",
      "--dir",
      ownRedis!.dir,
      "--appendonly",
      "yes",
      "--appendfsync",
      "always",
      "--save",
      "",
    ],
    stdout: "null",
    stderr: "null",
  }).spawn();
  for (let i = 0; i < 100; i++) {
    try {
      const probe = new Redis({ port: ownRedis!.port, host: "127.0.0.1", lazyConnect: true, maxRetriesPerRequest: 0 });
      probe.on("error", () => {});
      await probe.connect();
      await probe.ping();
      await probe.quit();
      return;
    } catch {
      await sleep(50);
    }
  }
  throw new Error("own redis-server did not start");
}

let cluster: LocalCluster | undefined;
if (CLUSTER) {
  cluster = await startLocalCluster({ aof: true });
  redisUrl = cluster.nodes.join(",");
} else if (REDIS_RESTART) {
  ownRedis = { port: freePort(), dir: await Deno.makeTempDir({ prefix: "oncely-chaos-redis-" }) };
  await startOwnRedis();
  redisUrl = `redis://127.0.0.1:${ownRedis.port}/0`;
} else {
  redisUrl = await emptyRedisDatabase("redis://127.0.0.1:6379/0");
}
const redisAdmin: RedisClient = CLUSTER
  ? await connectRedis(redisUrl)
  : new Redis(redisUrl, { maxRetriesPerRequest: null });
redisAdmin.on("error", () => {});

// ---------------------------------------------------------------- processes
const apiPort = freePort();
// Four tenants, so four lanes: on a cluster they spread over the masters.
const TENANTS = ["chaos-a", "chaos-b", "chaos-c", "chaos-d"];
const apiKeys = await Promise.all(TENANTS.map((tenant) => createApiKey(db.sql, tenant)));
// Every fourth job asks for a webhook: a receiver that verifies signatures, dedupes webhook-ids, fails 10%.
const secrets = new Map(
  await Promise.all(TENANTS.map(async (t) => [t, (await ensureWebhookSecret(db.sql, t))!] as const)),
);
const receiver = startFakeWebhookReceiver(secrets, () => random() < 0.1);
const wantsWebhook = (i: number) => i % 4 === 3;
const env: Record<string, string> = {
  DATABASE_URL: db.url,
  REDIS_URL: redisUrl,
  PORT: String(apiPort),
  OPENAI_API_KEY: "sk-chaos",
  OPENAI_BASE_URL: model.url,
  RESEND_API_KEY: "re_chaos",
  RESEND_BASE_URL: mail.url,
  IDEMPOTENCY_LOCK_TTL_S: "3",
  CLAIM_IDLE_MS: "2000",
  MAX_DELIVERIES: "100",
  WORKER_CONCURRENCY: "16",
  JOB_BUDGET_S: "4",
  LLM_CALL_TIMEOUT_S: "1",
  RELAY_BATCH: "10",
  RELAY_MAX_ATTEMPTS: "1000",
  // The webhook receiver is on loopback, over http.
  WEBHOOK_ALLOW_HTTP: "true",
  WEBHOOK_ALLOW_PRIVATE: "true",
  MAIL_SEND_TIMEOUT_S: "1",
  LOG_LEVEL: "info",
  NO_COLOR: "1",
  LLM_BREAKER_COOLDOWN_S: "1",
};
const config = parseConfig(env);
const MAIN = decodeURIComponent(new URL("../../main.ts", import.meta.url).pathname);
const MIGRATIONS = decodeURIComponent(new URL("../../migrations/", import.meta.url).pathname);

/**
 * What `deno task <task>` runs for this configuration: main.ts with the
 * permission set derived from the configured URLs. Started directly (not
 * through the launcher), so a SIGKILL hits the service process itself.
 */
function taskArgs(task: Command): string[] {
  return ["run", ...permissionFlags(task, config, MIGRATIONS), MAIN, task];
}

interface Proc {
  name: string;
  task: Command;
  child: Deno.ChildProcess;
  log: Deno.FsFile;
}
const procs: Proc[] = [];
/** Processes that exited without being killed by us: each must survive Redis and Postgres restarts. */
const selfExits: string[] = [];
const killedByUs = new Set<Deno.ChildProcess>();

async function spawn(name: string, task: Command): Promise<Proc> {
  const log = await Deno.open(`${logDir}/${name}.log`, { append: true, create: true });
  const child = new Deno.Command(Deno.execPath(), { args: taskArgs(task), env, stdout: "piped", stderr: "piped" })
    .spawn();
  // Keep the pipes drained into the log file (a full pipe would stall the process).
  child.stdout.pipeTo(log.writable, { preventClose: true }).catch(() => {});
  child.stderr.pipeTo(log.writable, { preventClose: true }).catch(() => {});
  child.status.then((status) => {
    if (!killedByUs.has(child)) selfExits.push(`${name} (exit ${status.code})`);
  });
  return { name, task, child, log };
}

for (
  const [name, task] of [["api", "api"], ["worker-1", "worker"], ["worker-2", "worker"], ["relay-1", "relay"], [
    "relay-2",
    "relay",
  ]] as const
) procs.push(await spawn(name, task));

async function apiUp(timeoutMs: number) {
  const end = performance.now() + timeoutMs;
  while (performance.now() < end) {
    try {
      const res = await fetch(`http://127.0.0.1:${apiPort}/healthz`);
      await res.body?.cancel();
      if (res.ok) return;
    } catch { /* not yet */ }
    await sleep(100);
  }
  throw new Error(`the API did not come up; see ${logDir}/api.log`);
}
await apiUp(30_000);

// ---------------------------------------------------------------- clients
const accepted = new Map<string, string>(); // idempotency key -> job id
let submitted = 0, postRequests = 0;
let killing = true;
const BODY_WORDS = "revenue costs growth board plan quarter market customer contract region team".split(" ");

function document(i: number): string {
  return Array.from(
    { length: 6 },
    (_, s) =>
      `${BODY_WORDS[(i + s) % BODY_WORDS.length]} ${
        BODY_WORDS[(i * 7 + s) % BODY_WORDS.length]
      } changed in period ${s} of job ${i}.`,
  ).join(" ");
}

async function postOnce(key: string, body: string, apiKey: string): Promise<string | null> {
  postRequests++;
  try {
    const res = await fetch(`http://127.0.0.1:${apiPort}/v1/summaries`, {
      method: "POST",
      headers: { authorization: `Bearer ${apiKey}`, "idempotency-key": key, "content-type": "application/json" },
      body,
      signal: AbortSignal.timeout(5_000),
    });
    const text = await res.text();
    if (res.status === 202) return (JSON.parse(text) as { job_id: string }).job_id;
    if (res.status === 409 || res.status >= 500) return null; // retry later, as clients do
    throw new Error(`POST answered ${res.status}: ${text}`);
  } catch (error) {
    if (error instanceof Error && error.message.startsWith("POST answered")) throw error;
    return null; // connection refused or reset: the API is restarting
  }
}

/** Jobs whose result goes to the webhook receiver instead of an email. */
const webhookJobs = new Set<string>();

/** One logical request: sent, then retried 1-3 times (sometimes concurrently), then until it gets a 202. */
async function submit(i: number) {
  const key = `chaos-${SEED}-${String(i).padStart(6, "0")}`;
  const apiKey = apiKeys[i % apiKeys.length]!;
  const notify = wantsWebhook(i)
    ? { webhook: `${receiver.url}/${TENANTS[i % TENANTS.length]}` }
    : `user${i}@example.com`;
  const body = JSON.stringify({ text: document(i), notify });
  const copies = 2 + Math.floor(random() * 3); // the first send and 1-3 retries
  const concurrent = random() < 0.3;
  const ids: (string | null)[] = [];
  if (concurrent) ids.push(...await Promise.all(Array.from({ length: copies }, () => postOnce(key, body, apiKey))));
  else for (let c = 0; c < copies; c++) ids.push(await postOnce(key, body, apiKey));
  let jobId = ids.find((id) => id !== null) ?? null;
  const end = performance.now() + 120_000;
  for (let delay = 100; jobId === null && performance.now() < end; delay = Math.min(delay * 2, 1_000)) {
    await sleep(delay + random() * 100);
    jobId = await postOnce(key, body, apiKey);
  }
  if (jobId === null) throw new Error(`POST for ${key} never got a 202 in 120 s`);
  accepted.set(key, jobId);
  if (wantsWebhook(i)) webhookJobs.add(jobId);
  submitted++;
}

// ---------------------------------------------------------------- chaos
let kills = 0;
const events: string[] = [];
/** Switches the limited provider's outages on and off on schedule, until the kill period ends. */
async function outageLoop(end: number) {
  while (limited && performance.now() < end) {
    const elapsed = 1 - (end - performance.now()) / (DURATION_S * 1000);
    const outage = elapsed >= 0.25 && elapsed < 0.35 ? "quota" : elapsed >= 0.5 && elapsed < 0.6 ? "503" : null;
    if (outage && !events.includes(`provider outage: ${outage}`)) events.push(`provider outage: ${outage}`);
    limited.setOutage(outage);
    await sleep(50);
  }
  limited?.setOutage(null);
}

/** The index (in `cluster.nodes`) of the master that serves `key`'s slot. */
async function masterOf(key: string): Promise<number> {
  const slot = await redisAdmin.cluster("KEYSLOT", key) as number;
  const ranges = await redisAdmin.cluster("SLOTS");
  const owner = ranges.find(([from, to]) => slot >= from && slot <= to)!;
  return cluster!.nodes.indexOf(`redis://127.0.0.1:${owner[2]![1]}`);
}

async function killLoop() {
  const end = performance.now() + DURATION_S * 1000;
  const outages = outageLoop(end);
  let redisRestarted = !REDIS_RESTART, pgTerminated = !PG_TERMINATE, masterRestarted = !CLUSTER;
  while (performance.now() < end) {
    await sleep(1_000 + random() * 2_000);
    if (performance.now() >= end) break;
    const elapsed = 1 - (end - performance.now()) / (DURATION_S * 1000);
    if (!redisRestarted && elapsed > 0.4) {
      redisRestarted = true;
      events.push("redis-server killed and restarted");
      ownRedis!.child!.kill("SIGKILL");
      await ownRedis!.child!.status;
      await sleep(500);
      await startOwnRedis();
      continue;
    }
    if (!masterRestarted && elapsed > 0.4) {
      masterRestarted = true;
      // The master that serves the first tenant's lane: its jobs are in flight when it dies.
      const index = await masterOf(serviceKeys(KEY_PREFIX).lane(TENANTS[0]!).stream);
      await cluster!.restart(index);
      events.push(`cluster master ${cluster!.nodes[index]} killed (SIGKILL) and restarted from its AOF`);
      continue;
    }
    if (!pgTerminated && elapsed > 0.6) {
      pgTerminated = true;
      const admin = postgres(ADMIN_URL, { max: 1, onnotice: () => {} });
      const [row] = await admin<{ n: number }[]>`
        SELECT count(pg_terminate_backend(pid))::int AS n FROM pg_stat_activity
        WHERE datname = ${db.name} AND application_name = 'oncely' AND pid <> pg_backend_pid()`;
      await admin.end();
      events.push(`pg_terminate_backend on ${row!.n} service connections`);
      continue;
    }
    if (NO_KILLS) continue;
    const victim = pick(procs);
    killedByUs.add(victim.child);
    victim.child.kill("SIGKILL");
    await victim.child.status;
    kills++;
    const replacement = await spawn(victim.name, victim.task);
    procs[procs.indexOf(victim)] = replacement;
    victim.log.close();
  }
  await outages;
  killing = false;
}

async function countDone(): Promise<number> {
  const [row] = await db.sql<{ n: number }[]>`SELECT count(*)::int AS n FROM summaries`;
  return row!.n;
}

let done = 0;
const started = performance.now();
const tty = Deno.stderr.isTerminal();
let lastLine = 0;
function drawProgress(final = false) {
  const width = 30;
  const filled = Math.round((done / JOBS) * width);
  const bar = "#".repeat(Math.min(width, filled)) + ".".repeat(Math.max(0, width - filled));
  const line = `[${bar}] submitted ${submitted}/${JOBS}  done ${done}/${JOBS}  killed ${kills}${
    killing ? "" : " (kills over)"
  }  ${((performance.now() - started) / 1000).toFixed(0)} s`;
  if (tty) stderr(`\r${line}${final ? "\n" : ""}`);
  else if (final || performance.now() - lastLine > 3_000) {
    lastLine = performance.now();
    stderr(line + "\n");
  }
}

let failure: unknown;
let drainSeconds = NaN;
try {
  const chaos = killLoop();
  const progress = setInterval(() => {
    countDone().then((n) => (done = n), () => {});
    drawProgress();
  }, 250);
  try {
    // Submit with 16 clients in parallel, spread over most of the kill period.
    const spacingMs = (DURATION_S * 800) / Math.max(1, JOBS);
    let next = 0;
    await Promise.all(Array.from({ length: 16 }, async () => {
      while (next < JOBS) {
        const i = next++;
        const due = started + i * spacingMs;
        if (due > performance.now()) await sleep(due - performance.now());
        await submit(i);
      }
    }));
    await chaos;
    const drainStart = performance.now();
    const end = drainStart + DRAIN_TIMEOUT_S * 1000;
    const expected = new Set(accepted.values());
    while (performance.now() < end) {
      done = await countDone();
      const keys = new Set([...mail.delivered.map((d) => d.idempotencyKey), ...receiver.processed.keys()]);
      const notified = (id: string) =>
        keys.has(`${webhookJobs.has(id) ? SUMMARY_WEBHOOK_KEY_PREFIX : SUMMARY_READY_KEY_PREFIX}${id}`);
      if (done >= expected.size && [...expected].every(notified)) break;
      await sleep(200);
    }
    drainSeconds = (performance.now() - drainStart) / 1000;
  } finally {
    clearInterval(progress);
    done = await countDone().catch(() => done);
    drawProgress(true);
  }
} catch (error) {
  failure = error;
}

// ---------------------------------------------------------------- results
const jobIds = [...new Set(accepted.values())];
const summaries = await db.sql<{ job_id: string }[]>`SELECT job_id::text FROM summaries`;
const outbox = await db.sql<{ job_id: string }[]>`SELECT payload->>'job_id' AS job_id FROM outbox`;
const summaryIds = new Set(summaries.map((r) => r.job_id));
const lost = jobIds.filter((id) => !summaryIds.has(id)).length;
const dupSummaries = summaries.length - summaryIds.size;
const dupOutbox = outbox.length - new Set(outbox.map((r) => r.job_id)).size;
const unexpected = summaries.filter((r) => !jobIds.includes(r.job_id)).length;
const deliveredKeys = mail.delivered.map((d) => d.idempotencyKey);
const distinctEmails = new Set(deliveredKeys).size;
const dupEmails = deliveredKeys.length - distinctEmails;
const emailJobs = jobIds.filter((id) => !webhookJobs.has(id)).length;
const webhookIds = [...receiver.processed.keys()];
const webhooksRight = webhookIds.filter((id) => webhookJobs.has(receiver.processed.get(id)!)).length;
const dead = await allLanes(redisAdmin, serviceKeys(KEY_PREFIX))
  .then(async (lanes) => (await Promise.all(lanes.map((l) => redisAdmin.xlen(l.keys.dead)))).reduce((n, x) => n + x, 0))
  .catch(() => -1);

const rows: [string, string][] = [
  ["seed", String(SEED)],
  [
    "mode",
    [CLUSTER && "redis cluster", REDIS_RESTART && "redis restart", PG_TERMINATE && "pg_terminate_backend"]
      .filter(Boolean).join(", ") ||
    "process kills",
  ],
  ["jobs accepted", String(jobIds.length)],
  ["POST requests sent (with client retries)", String(postRequests)],
  ["processes killed (SIGKILL)", String(kills)],
  ["processes that exited on their own", selfExits.length ? selfExits.join(", ") : "0"],
  ...events.map((e): [string, string] => ["infrastructure event", e]),
  ["jobs lost (accepted but never done)", String(lost)],
  ["dead-lettered", String(dead)],
  ["duplicate summaries", String(dupSummaries)],
  ["duplicate outbox rows", String(dupOutbox)],
  ["summaries for jobs never accepted", String(unexpected)],
  ["distinct emails delivered / expected", `${distinctEmails} / ${emailJobs}`],
  ["emails delivered twice", String(dupEmails)],
  ["distinct webhooks processed / expected", `${webhooksRight} / ${webhookJobs.size}`],
  ["webhook requests / redeliveries the receiver deduplicated", `${receiver.requests} / ${receiver.redelivered}`],
  ["webhooks failing signature verification", String(receiver.badSignatures)],
  ["send requests / duplicates the provider absorbed", `${mail.requests} / ${mail.deduplicated}`],
  ["model calls per job", jobIds.length ? (modelCalls / jobIds.length).toFixed(2) : "n/a"],
  ...(limited
    ? [[
      `provider limit ${PROVIDER_LIMIT}/s: answered ok / 429 over the limit / in outages`,
      `${limited.counts.ok} / ${limited.counts.rateLimited} / ${limited.counts.quota + limited.counts.unavailable}`,
    ] as [string, string]]
    : []),
  ["time to drain after the last kill", Number.isFinite(drainSeconds) ? `${drainSeconds.toFixed(1)} s` : "n/a"],
];
console.log("\n| chaos run | result |\n| --- | --- |");
for (const [k, v] of rows) console.log(`| ${k} | ${v} |`);

// ---------------------------------------------------------------- clean up
const stoppedCleanly = selfExits.length === 0;
for (const p of procs) {
  killedByUs.add(p.child);
  p.child.kill("SIGTERM");
}
await Promise.all(procs.map((p) => p.child.status));
for (const p of procs) p.log.close();
await model.close();
await mail.close();
await receiver.close();
if (!CLUSTER) await (redisAdmin as Redis).flushdb().catch(() => {});
await redisAdmin.quit().catch(() => redisAdmin.disconnect());
await cluster?.stop();
if (ownRedis) {
  ownRedis.child?.kill("SIGKILL");
  await ownRedis.child?.status;
  await Deno.remove(ownRedis.dir, { recursive: true });
}
await db.close();

const ok = !failure && stoppedCleanly && lost === 0 && dupSummaries === 0 && dupOutbox === 0 && unexpected === 0 &&
  dupEmails === 0 && distinctEmails === emailJobs && jobIds.length === JOBS &&
  webhooksRight === webhookJobs.size && webhookIds.length === webhookJobs.size && receiver.badSignatures === 0;
if (failure) console.error(`chaos run failed: ${failure instanceof Error ? failure.message : failure}`);
if (!ok) {
  console.error(`FAILED: the process logs are in ${logDir}`);
  Deno.exit(1);
}
await Deno.remove(logDir, { recursive: true });
console.log("\nOK: nothing lost, nothing duplicated.");
