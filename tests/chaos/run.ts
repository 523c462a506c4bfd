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
 *                   [--provider-limit RPS] [--cluster] [--new-tenants] [--drain-timeout S] [--poison N]
 *                   [--poison-runs N] [--pg-failover [--pg-async]]
 *                   [--sentinel [--replicas-ack N] [--ack-timeout-ms MS]] [--budgets] [--redis-drops [SHARE]]
 *                   [--deployments]
 *
 * Among the jobs are N (default 3) poison documents, on which the model always
 * hangs: each must be dead-lettered (after MAX_DELIVERIES=5 deliveries, charged
 * to itself, not to the provider), and nothing else may be.
 *
 * Every third job is a run of the task `triage` (PUT for every tenant before
 * the kills start) with a strict output schema, instead of a summary, with the
 * same mix of emails and webhooks. Each must be done once, with one
 * `run_results` row whose output validates against the schema, one outbox row
 * and one `run_done` email or `run.completed` webhook. Some runs get a first
 * answer that is not JSON and must be done after the repair call; N (default
 * 4, at most one per tenant of the four) poison runs get answers that always
 * break the schema, and must fail (`output_invalid`, dead-lettered) with their
 * `run_failed` email or `run.failed` webhook once.
 *
 * In every mode the runs carry a `priority` (high, normal, low, batch, each tenant all four) and two thirds of
 * them an `expires_in`, short (1 to 3 s) or long (10 minutes): see priorities.ts. A run with an expiry may end
 * `expired` instead of done (never a long one), with its `run_expired` email or `run.expired` webhook once and
 * nothing else, and only if it never called the model: an expired run with a model call fails the chaos run, and
 * so does a run whose first model request arrived after its `expires_at` (a run that started in time may retry
 * after it, and ends done or failed). The report gives each priority's runs, outcomes and median time from
 * acceptance to done, and the expired runs (with no model call, all of them).
 *
 * With --cluster, Redis is a local three-master Redis Cluster with AOF on
 * (fsync always) in a temporary directory, REDIS_URL lists its nodes, and one
 * master's process is SIGKILLed and restarted mid-run.
 *
 * With --sentinel, Redis is a primary with AOF, one replica and three
 * sentinels (tests/support/redis_sentinel.ts), REDIS_URL is their
 * redis+sentinel:// URL, and every process gets the permission set the
 * launcher derives for it, probe included (main.ts launchFlags), checked to
 * name the primary, the replica and the three sentinels. Every process runs
 * with REDIS_MIN_REPLICAS_ACK=1 (--replicas-ack N; 0 turns it off) and
 * REDIS_ACK_TIMEOUT_MS=500. Mid-run, once every process has logged its
 * start, the primary is SIGKILLed and a sentinel promotes the replica; no
 * process is killed until the API that answered /readyz 200 before the kill
 * answers 200 again, which must happen within 10 s of the promotion (the
 * times are reported). Later the old primary comes back as a replica of the
 * new one. Until then the new master has no replica, so with N=1 intake
 * answers 503 (retried with the same key, like any 5xx).
 *
 * With --provider-limit, the fake model also enforces RPS requests in any
 * sliding second with OpenAI's x-ratelimit-* headers and 429 bodies (the
 * workers learn the limit from them), and goes down twice during the kill
 * period: insufficient_quota for 10% of it, then 503 for 10% of it, with a
 * 1 s breaker cooldown.
 *
 * With --new-tenants, 90% of the jobs come from tenants created for this run
 * that have never posted (most post one job, some two or three), submitted in
 * one wave a second, and half the kills go to the API, each aimed a few
 * milliseconds after a wave has left, so some land between a new tenant's
 * intake script and its lane announce. A quarter of the new tenants' clients
 * give up after a connection error instead of retrying. Afterwards every
 * submitted key is checked by its job id: an accepted (202) job, or one whose
 * intake ran though its POST was never answered, must be done exactly once; an
 * unanswered one whose intake never ran must have left nothing. A job queued
 * but never done is reported as stranded, with its tenant and lane. The drain
 * timeout defaults to 60 s in this mode (past the workers' 30 s lane sweep).
 *
 * With --budgets, two tenants get a budget (tokens, USD) that the run's load
 * spends partway through the kill period, the fake model reports usage from
 * each request's length, and the run holds the provider's own count to the
 * budgets; see budgets.ts.
 *
 * With --redis-drops [SHARE] (default 3%, as `0.03` or `3%`), the API, the
 * workers, the relays and the tenant command reach Redis through a proxy
 * (tests/support/redis_drop_proxy.ts) that drops SHARE of the replies with
 * their connection, after Redis ran the command: ioredis reconnects and
 * resends what was unanswered (or aborts what followed a partial pipeline
 * reply), so every script runs again or leaves its effect unheard. The run's
 * own checks keep a direct connection. Budgets are on (as --budgets), and at
 * the end, once the calls are over, each budget is reconciled exactly with
 * the provider's ledger and the service's record (budgets.ts): its spend
 * within 2% of what the settled calls cost, nothing reserved beyond what the
 * calls a kill cut off may hold. With the usual checks, and in every mode:
 * exactly one dead letter per poison job (the dead streams counted by job id).
 *
 * With --deployments, LLM_DEPLOYMENTS names three fake providers, each with
 * its own key, limit and x-ratelimit-* headers: two serve the default model
 * `primary`, a third `backup`, which the task lists after it. Mid-run one of
 * the first two has a 503 outage, recovers, then runs out of quota, and for a
 * while the other is down too (the runs fall back, the summaries wait); the
 * calls each outage received must stay within the breaker's bound, and the
 * report gives each deployment's calls and the runs that fell back: see
 * deployments.ts.
 *
 * With --pg-failover, Postgres is a primary and a synchronous standby (an
 * asynchronous one with --pg-async), DATABASE_URL lists both, and mid-run the
 * primary is stopped (immediate) and the standby promoted: see pg_failover.ts.
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
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { RUN_KEY_PREFIX, SUMMARY_READY_KEY_PREFIX, SUMMARY_WEBHOOK_KEY_PREFIX } from "../../src/runs/shapes.ts";
import { compileSchema } from "../../src/tasks/json_schema.ts";
import { ensureWebhookSecret } from "../../src/tenants/webhook_secrets.ts";
import { startFakeWebhookReceiver } from "../support/fake_webhook_receiver.ts";
import { KEY_PREFIX, serviceKeys } from "../../src/runs/keys.ts";
import { SUMMARIES } from "../../src/summaries/api.ts";
import { canonicalJson } from "../../src/idempotency/fingerprint.ts";
import { jobIdFor } from "../../src/idempotency/scope.ts";
import { allLanes } from "../../src/runs/all_lanes.ts";
import { listDeadLetters } from "../../src/queue/dead_letter.ts";
import { startFakeMail } from "../support/fake_mail_server.ts";
import {
  type ChatBody,
  limitedProvider,
  type ModelBehaviour,
  startFakeModel,
  STRUCTURED_MARKERS,
} from "../support/fake_model_server.ts";
import { type RedisDropProxy, startRedisDropProxy } from "../support/redis_drop_proxy.ts";
import { createScratchDatabase, emptyRedisDatabase, releaseRedisDatabase } from "../support/scratch.ts";
import { type LocalCluster, startLocalCluster } from "../support/redis_cluster.ts";
import { type RedisSentinel, startRedisSentinel } from "../support/redis_sentinel.ts";
import { connectRedis, type RedisClient } from "../../src/clients.ts";
import { launchFlags } from "../../main.ts";
import { apiHealthy, createSpawner, MAIN, numberOption, type Proc, stopAll, taskArgsOf } from "./_processes.ts";
import { freePort } from "../support/free_port.ts";
import { seededRandom } from "../support/random.ts";
import { pgFailoverMode, startPgFailover } from "./pg_failover.ts";
import { burstJobs, chaosBudgets, PRICE_ENV, RAISE_AT, type RequestKind } from "./budgets.ts";
import { MAX_OUTPUT_TOKENS, summaryPrompt } from "../../src/llm/llm.ts";
import { chaosDeployments, TASK_MODELS } from "./deployments.ts";
import { createPrices } from "../../src/llm/prices.ts";
import {
  checkPriorities,
  HANGS_FIRST_MARK,
  hangsFirst,
  type PlannedRun,
  type RunExtras,
  runExtras,
} from "./priorities.ts";

const args = Deno.args;
const flag = (name: string) => args.includes(`--${name}`);
const option = (name: string, fallback: number) => numberOption(args, name, fallback);
/** --redis-drops' share: the value after the flag (`0.03` or `3%`) if there is one, else 3%; 0 without the flag. */
function dropShare(): number {
  const i = args.indexOf("--redis-drops");
  if (i < 0) return 0;
  const given = args[i + 1];
  if (given === undefined || given.startsWith("--")) return 0.03;
  const share = given.endsWith("%") ? Number(given.slice(0, -1)) / 100 : Number(given);
  if (!(share > 0 && share < 1)) {
    console.error(`--redis-drops takes a share of replies above 0 and below 1, as 0.03 or 3% (got ${given})`);
    Deno.exit(2);
  }
  return share;
}
const NEW_TENANTS = flag("new-tenants");
const JOBS = option("jobs", 500);
const DURATION_S = option("duration", 30);
const DRAIN_TIMEOUT_S = option("drain-timeout", NEW_TENANTS ? 60 : 180);
/** Poison documents among the jobs: early in the run (so their five deliveries fit in it), email ones. */
const POISON = option("poison", 3);
const poisonIndices = new Set(Array.from({ length: Math.min(POISON, Math.floor(JOBS / 8)) }, (_, k) => 4 * k + 4));
const POISON_MARK = "POISON-DOCUMENT";
const BODY_WORDS = "revenue costs growth board plan quarter market customer contract region team".split(" ");
/** Poison runs: at most one per tenant of the four, early in the run. */
const POISON_RUNS = option("poison-runs", 4);
/** How a run's ticket starts (`Ticket <job index>:`), so the fake model's requests name their run. */
const TICKET_INDEX = /\bTicket (\d+):/;
const REDIS_RESTART = flag("redis-restart");
const CLUSTER = flag("cluster");
const SENTINEL = flag("sentinel");
/** With --sentinel: REDIS_MIN_REPLICAS_ACK for every process (0: a 202 waits for no replica). */
const REPLICAS_ACK = option("replicas-ack", SENTINEL ? 1 : 0);
const ACK_TIMEOUT_MS = option("ack-timeout-ms", 500);
if (!SENTINEL && (args.includes("--replicas-ack") || args.includes("--ack-timeout-ms"))) {
  console.error("--replicas-ack and --ack-timeout-ms need --sentinel (only that mode starts a replica)");
  Deno.exit(2);
}
if (SENTINEL && (CLUSTER || flag("redis-restart"))) {
  console.error("--sentinel starts its own Redis: it does not go with --cluster or --redis-restart");
  Deno.exit(2);
}
/** With --sentinel: the most the API may take to answer /readyz 200 again after the sentinels promote the replica. */
const READYZ_BOUND_MS = 10_000;
const PG_TERMINATE = flag("pg-terminate");
const PG_FAILOVER = pgFailoverMode(args);
const NO_KILLS = flag("no-kills");
const PROVIDER_LIMIT = option("provider-limit", 0);
/** --redis-drops [SHARE]: the share of the processes' Redis replies the proxy drops with their connection. */
const REDIS_DROPS = dropShare();
const BUDGETS = flag("budgets") || REDIS_DROPS > 0;
if (REDIS_DROPS > 0 && (CLUSTER || SENTINEL)) {
  // A cluster's MOVED and a sentinel's answer name the nodes' own ports: clients would go around the proxy.
  console.error("--redis-drops puts a proxy in front of one Redis server: it does not go with --cluster or --sentinel");
  Deno.exit(2);
}
if (BUDGETS && NEW_TENANTS) {
  console.error(
    "--budgets (and --redis-drops) puts two of the four usual tenants on a budget: it does not go with --new-tenants",
  );
  Deno.exit(2);
}
/** --deployments: the model calls go to three deployments of their own (deployments.ts), one of them broken mid-run. */
const DEPLOYMENTS = flag("deployments");
if (DEPLOYMENTS && (PROVIDER_LIMIT > 0 || BUDGETS)) {
  // Each deployment has its own limit, and the budgets' ledger reads the one provider of the other modes.
  console.error("--deployments gives each deployment its own limit: it does not go with --provider-limit or --budgets");
  Deno.exit(2);
}
const SEED = option("seed", Date.now() % 1_000_000);
const random = seededRandom(SEED);
const pick = <T>(items: T[]) => items[Math.floor(random() * items.length)]!;

const ADMIN_URL = Deno.env.get("CHAOS_DATABASE_URL") ?? "postgres://postgres@127.0.0.1:5432/postgres";
const logDir = await Deno.makeTempDir({ prefix: "oncely-chaos-" });
const stderr = (line: string) => Deno.stderr.writeSync(new TextEncoder().encode(line));

// ---------------------------------------------------------------- providers
let modelCalls = 0;
/** Per run (its job index): the structured answers the model gave, to the first call and to repair calls. */
const structuredAnswers = new Map<number, { first: number; repair: number }>();
/** Counts a request's answer if it is a structured one for a run of the task (its first user message names it). */
function countStructuredAnswer(body: ChatBody | undefined) {
  if (body?.response_format?.type !== "json_schema") return;
  const named = TICKET_INDEX.exec(body.messages?.find((m) => m.role === "user")?.content ?? "");
  if (!named) return;
  const i = Number(named[1]);
  const counts = structuredAnswers.get(i) ?? { first: 0, repair: 0 };
  if (body.messages?.some((m) => m.role === "assistant")) counts.repair++;
  else counts.first++;
  structuredAnswers.set(i, counts);
}
const limited = PROVIDER_LIMIT > 0 ? limitedProvider({ rps: PROVIDER_LIMIT }) : undefined;
/** How the model answered each request (by n - 1): billed, refused with a status, or left hanging. */
const requestKinds: RequestKind[] = [];
/** `respond`, noting how each request was answered. */
function noteKind(respond: (n: number, prompt: string) => ModelBehaviour) {
  return (n: number, prompt: string): ModelBehaviour => {
    const behaviour = respond(n, prompt);
    requestKinds[n - 1] = behaviour.kind === "ok" ? "ok" : behaviour.kind === "status" ? "status" : "hang";
    return behaviour;
  };
}
/**
 * How the chaos model answers a request its provider's limit (if any) let through, whose answer carries `headers`:
 * random 429s, 503s and hangs, a hang for every poison document, else a completion.
 */
function chaosAnswer(body: ChatBody | undefined, prompt: string, headers?: Record<string, string>): ModelBehaviour {
  if (prompt.includes(POISON_MARK)) return { kind: "hang" };
  // A run with a short expiry marked so: its first request hangs (priorities.ts).
  const job = body && prompt.includes(HANGS_FIRST_MARK) ? jobOfRequest(body) : undefined;
  if (job !== undefined && !hungOnce.has(job)) {
    hungOnce.add(job);
    return { kind: "hang" };
  }
  const r = random();
  if (r < 0.08) return { kind: "status", status: 429, headers: { "retry-after": "0.2" } };
  if (r < 0.14) return { kind: "status", status: 503 };
  if (r < 0.17) return { kind: "hang" };
  countStructuredAnswer(body);
  return {
    kind: "ok",
    delayMs: 5 + Math.floor(random() * 30),
    headers,
    // With budgets, the provider bills what it was sent and what it wrote, as a real one does.
    ...(BUDGETS ? { usage: "realistic" as const } : {}),
  };
}
/** The runs marked HANGS_FIRST_MARK whose first request was left hanging (by job index). */
const hungOnce = new Set<number>();
/** The one provider OPENAI_* names (with --deployments, none of the processes may call it). */
const model = startFakeModel(noteKind((n, prompt) => {
  modelCalls++;
  const gate = limited?.respond(n, prompt);
  if (gate && gate.kind !== "ok") return gate;
  return chaosAnswer(
    model.bodies[n - 1] as ChatBody | undefined,
    prompt,
    gate?.kind === "ok" ? gate.headers : undefined,
  );
}));
const deployments = DEPLOYMENTS
  ? chaosDeployments({ answer: chaosAnswer, cooldownMs: 1_000, durationMs: DURATION_S * 1000 })
  : undefined;
const mail = startFakeMail(() => (random() < 0.1 ? { kind: "status", status: 500 } : { kind: "ok" }));

// ---------------------------------------------------------------- Redis and Postgres
const pgPair = PG_FAILOVER ? await startPgFailover(PG_FAILOVER) : undefined;
const db = pgPair?.db ?? await createScratchDatabase(ADMIN_URL, { prefix: "oncely_chaos" });
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
let sentinel: RedisSentinel | undefined;
if (CLUSTER) {
  cluster = await startLocalCluster({ aof: true });
  redisUrl = cluster.nodes.join(",");
} else if (SENTINEL) {
  sentinel = await startRedisSentinel();
  redisUrl = sentinel.url;
} else if (REDIS_RESTART) {
  ownRedis = { port: freePort(), dir: await Deno.makeTempDir({ prefix: "oncely-chaos-redis-" }) };
  await startOwnRedis();
  redisUrl = `redis://127.0.0.1:${ownRedis.port}/0`;
} else {
  // CHAOS_REDIS_URL: another server than the shared local one (whose empty database indexes other runs pick too).
  redisUrl = await emptyRedisDatabase(Deno.env.get("CHAOS_REDIS_URL") ?? "redis://127.0.0.1:6379/0");
}
// On a cluster, or behind the sentinels (a client that follows the failover), the service's own client.
const redisAdmin: RedisClient = CLUSTER || SENTINEL
  ? await connectRedis(redisUrl)
  : new Redis(redisUrl, { maxRetriesPerRequest: null });
redisAdmin.on("error", () => {});
// --redis-drops: the processes reach Redis through the proxy, at the same database index; the run's checks do not.
let dropProxy: RedisDropProxy | undefined;
let processRedisUrl = redisUrl;
if (REDIS_DROPS > 0) {
  const direct = new URL(redisUrl);
  dropProxy = startRedisDropProxy({
    target: { hostname: direct.hostname, port: Number(direct.port || 6379) },
    share: REDIS_DROPS,
    seed: SEED,
  });
  processRedisUrl = dropProxy.url(Number(direct.pathname.slice(1) || 0));
}

// ---------------------------------------------------------------- processes
const apiPort = freePort();
// Four tenants, so four lanes: on a cluster they spread over the masters.
const TENANTS = ["chaos-a", "chaos-b", "chaos-c", "chaos-d"];

/** Who sends job i, and how its client behaves. */
interface JobPlan {
  tenant: string;
  /** The tenant was created for this run and had never posted before its first job here. */
  fresh: boolean;
  /** The tenant's first job in this run. */
  first: boolean;
  /** The client retries a POST that got no answer (with --new-tenants, a quarter of new tenants' clients do not). */
  retries: boolean;
}
/** With --new-tenants: the share of jobs from new tenants, and of their clients that give up on a connection error. */
const FRESH_SHARE = 0.9, GIVE_UP_SHARE = 0.25;
const plans: JobPlan[] = [];
{
  const seen = new Set<string>();
  let fresh = 0, left = 0;
  for (let i = 0; i < JOBS; i++) {
    // Outside --new-tenants, no random number is drawn here, so a seed repeats the runs it always did.
    if (!NEW_TENANTS || random() >= FRESH_SHARE) {
      const tenant = TENANTS[i % TENANTS.length]!;
      plans.push({ tenant, fresh: false, first: !seen.has(tenant), retries: true });
      seen.add(tenant);
      continue;
    }
    if (left === 0) {
      // Most new tenants post one job; some two or three, submitted close together.
      const r = random();
      left = r < 0.7 ? 1 : r < 0.9 ? 2 : 3;
      fresh++;
    }
    left--;
    const tenant = `fresh-${String(fresh).padStart(4, "0")}`;
    plans.push({ tenant, fresh: true, first: !seen.has(tenant), retries: random() >= GIVE_UP_SHARE });
    seen.add(tenant);
  }
}
const freshTenants = [...new Set(plans.filter((p) => p.fresh).map((p) => p.tenant))];
const tenantsStarted = performance.now();
// New tenants are made the way the old ones are (the tenant store's own functions), before any process starts:
// a tenant row and an API key are all the service sees of them until their first POST.
const apiKeys = new Map(
  await Promise.all([...TENANTS, ...freshTenants].map(async (t) => [t, await createApiKey(db.sql, t)] as const)),
);
// Every fourth job asks for a webhook: a receiver that verifies signatures, dedupes webhook-ids, fails 10%.
const secrets = new Map(
  await Promise.all(
    [...TENANTS, ...freshTenants].map(async (t) => [t, (await ensureWebhookSecret(db.sql, t))!] as const),
  ),
);
const tenantSetupS = (performance.now() - tenantsStarted) / 1000;
const receiver = startFakeWebhookReceiver(secrets, () => random() < 0.1);
const wantsWebhook = (i: number) => i % 4 === 3 && !poisonIndices.has(i);

// ---------------------------------------------------------------- task runs
/** The task whose runs are mixed into the jobs: structured output against a strict schema. */
const TASK = "triage";
const TASK_RUNS = `/v1/tasks/${TASK}/runs`;
const TRIAGE = {
  prompt: "Triage this support ticket. Answer with JSON only.\n\n{{input.ticket}}",
  input_schema: {
    type: "object",
    properties: { ticket: { type: "string", minLength: 1 } },
    required: ["ticket"],
    additionalProperties: false,
  },
  output_schema: {
    type: "object",
    properties: {
      category: { type: "string", enum: ["billing", "bug", "question", "other"] },
      priority: { type: "integer", minimum: 1, maximum: 4 },
      summary: { type: "string", minLength: 3, maxLength: 200 },
      labels: { type: "array", items: { type: "string", minLength: 1 }, minItems: 1, maxItems: 5 },
      customer: {
        type: "object",
        properties: { tier: { type: "string", enum: ["free", "pro", "enterprise"] }, churn_risk: { type: "boolean" } },
        required: ["tier", "churn_risk"],
        additionalProperties: false,
      },
    },
    required: ["category", "priority", "summary", "labels", "customer"],
    additionalProperties: false,
  },
};
/** Every third job (not a poison document) is a run of the task: the tenants' turns and the notify mix stay as they were. */
const isRun = (i: number) => i % 3 === 2 && !poisonIndices.has(i);
/** The first run of each tenant's turn (`i % 4`), up to --poison-runs: the model's answers always break the schema. */
const poisonRunIndices = new Set<number>();
{
  const turns = new Set<number>();
  const wanted = Math.min(POISON_RUNS, Math.floor(JOBS / 8));
  for (let i = 0; i < JOBS && poisonRunIndices.size < wanted; i++) {
    if (isRun(i) && !turns.has(i % 4)) {
      turns.add(i % 4);
      poisonRunIndices.add(i);
    }
  }
}
/** Every fifth other run: the first answer is not JSON, the repair call's is valid. */
const breaksOnce = (i: number) => isRun(i) && !poisonRunIndices.has(i) && Math.floor(i / 3) % 5 === 3;
const isPoison = (i: number) => poisonIndices.has(i) || poisonRunIndices.has(i);
const outputSchema = compileSchema(TRIAGE.output_schema);
const env: Record<string, string> = {
  DATABASE_URL: db.url,
  REDIS_URL: processRedisUrl,
  PORT: String(apiPort),
  ...(deployments ? deployments.env : { OPENAI_API_KEY: "sk-chaos", OPENAI_BASE_URL: model.url }),
  RESEND_API_KEY: "re_chaos",
  RESEND_BASE_URL: mail.url,
  IDEMPOTENCY_LOCK_TTL_S: "3",
  CLAIM_IDLE_MS: "2000",
  // Low enough for the poison documents to be dead-lettered within the run; a healthy job loses a delivery
  // only to a kill of the worker holding it, or to four failed attempts in a row (about 1 in 10,000).
  MAX_DELIVERIES: "5",
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
  ...(SENTINEL ? { REDIS_MIN_REPLICAS_ACK: String(REPLICAS_ACK), REDIS_ACK_TIMEOUT_MS: String(ACK_TIMEOUT_MS) } : {}),
  ...(BUDGETS ? PRICE_ENV : {}),
};
const config = parseConfig(env);

/**
 * What `deno task <task>` runs for this configuration: main.ts with the
 * permission set derived from the configured URLs. Started directly (not
 * through the launcher), so a SIGKILL hits the service process itself.
 * Behind Sentinel the URL names only the sentinels, so the set is the
 * launcher's own (its probe asks them for the nodes), derived again for
 * every start as `deno task` would, and checked to name every node.
 */
async function taskArgs(task: Command): Promise<string[]> {
  if (!sentinel) return taskArgsOf(task, config);
  const flags = await launchFlags(task, config);
  // The relay's set must keep every node out, the others' must let every node in.
  const net = flags.find((f) => f.startsWith("--deny-net=")) ?? flags.find((f) => f.startsWith("--allow-net="));
  const named = new Set(net?.slice(net.indexOf("=") + 1).split(","));
  const nodes = [sentinel.primaryPort, sentinel.replicaPort, ...sentinel.sentinelPorts];
  const missing = nodes.filter((port) => !named.has(`127.0.0.1:${port}`));
  if (missing.length > 0) {
    throw new Error(`the launcher's permission set for ${task} leaves out Redis nodes ${missing.join(", ")}: ${net}`);
  }
  launcherSets++;
  return ["run", ...flags, MAIN, task];
}
/** With --sentinel: permission sets the launcher derived, each checked to name every node. */
let launcherSets = 0;

const procs: Proc[] = [];
/** Processes that exited without being killed by us (`selfExits`): each must survive Redis and Postgres restarts. */
const { spawn, killedByUs, selfExits } = createSpawner({ logDir, env, argsOf: taskArgs });

// ---------------------------------------------------------------- budgets
/** The first model call of job i, as the worker sends it: what --budgets sizes the budgets by. */
function firstCall(i: number): ChatBody {
  const common = { model: config.OPENAI_MODEL, max_completion_tokens: MAX_OUTPUT_TOKENS };
  if (!isRun(i)) return { ...common, messages: [{ role: "user", content: summaryPrompt(document(i)) }] };
  return {
    ...common,
    messages: [{ role: "user", content: TRIAGE.prompt.replace("{{input.ticket}}", ticket(i)) }],
    response_format: { type: "json_schema", json_schema: { schema: TRIAGE.output_schema } },
  };
}
/** The job a model request is for: every document names its job (`of job <i>.`), summaries' and runs' alike. */
const JOB_NAMED = /\bof job (\d+)\./;
function jobOfRequest(body: ChatBody): number | undefined {
  const named = JOB_NAMED.exec(body.messages?.find((m) => m.role === "user")?.content ?? "");
  return named ? Number(named[1]) : undefined;
}
/** `deno task tenant ARGS...` against this run's service (retried: it may meet a restarting Redis). */
async function tenantCommand(args: string[]): Promise<string> {
  for (let attempt = 1;; attempt++) {
    const out = await new Deno.Command(Deno.execPath(), {
      args: [...(await taskArgs("tenant")), ...args],
      env,
      stdout: "piped",
      stderr: "piped",
    }).output();
    if (out.success) return new TextDecoder().decode(out.stdout);
    if (attempt === 5) {
      throw new Error(`tenant ${args.join(" ")} exited ${out.code}: ${new TextDecoder().decode(out.stderr).trim()}`);
    }
    await sleep(1_000);
  }
}
/** A GET of the API as `tenant`: its status and JSON body, or null without an answer. */
async function getAs(tenant: string, path: string) {
  try {
    const res = await fetch(`http://127.0.0.1:${apiPort}${path}`, {
      headers: { authorization: `Bearer ${apiKeys.get(tenant)}` },
      signal: AbortSignal.timeout(3_000),
    });
    return { status: res.status, body: await res.json() as Record<string, unknown> };
  } catch {
    return null;
  }
}
const budgetMode = BUDGETS
  ? chaosBudgets({
    sql: db.sql,
    redis: redisAdmin,
    keys: serviceKeys(KEY_PREFIX),
    prices: createPrices(config),
    model,
    jobs: plans.map((p, i) => ({ tenant: p.tenant, body: firstCall(i) })),
    jobOf: jobOfRequest,
    tenantCommand,
    get: getAs,
    start: () => started,
    ...(REDIS_DROPS > 0
      ? {
        reconcile: {
          kindOf: (n: number) => requestKinds[n - 1],
          jobIndexOf: (jobId: string) => submissions.find((s) => idOf(s) === jobId)?.i,
          callTimeoutMs: config.LLM_CALL_TIMEOUT_S * 1000,
        },
      }
      : {}),
  })
  : undefined;
await budgetMode?.setUp();

for (
  const [name, task] of [["api", "api"], ["worker-1", "worker"], ["worker-2", "worker"], ["relay-1", "relay"], [
    "relay-2",
    "relay",
  ]] as const
) procs.push(await spawn(name, task));

/** Waits until the API answers /healthz. */
const apiUp = (timeoutMs: number) => apiHealthy(apiPort, timeoutMs, logDir);
await apiUp(30_000);

/**
 * PUTs the task for every tenant the run uses (new tenants too), before the kills start: a PUT is idempotent by
 * content, so one that got no answer is sent again. @returns the version each PUT answered.
 */
async function putTaskEverywhere(): Promise<Set<number>> {
  const tenants = [...new Set(plans.map((p) => p.tenant))];
  const versions = new Set<number>();
  let next = 0;
  await Promise.all(Array.from({ length: 8 }, async () => {
    while (next < tenants.length) {
      const tenant = tenants[next++]!;
      for (let attempt = 1;; attempt++) {
        const res = await fetch(`http://127.0.0.1:${apiPort}/v1/tasks/${TASK}`, {
          method: "PUT",
          headers: { authorization: `Bearer ${apiKeys.get(tenant)}`, "content-type": "application/json" },
          // With --deployments the task falls back to `backup` when `primary` is unavailable.
          body: JSON.stringify(deployments ? { ...TRIAGE, model: TASK_MODELS } : TRIAGE),
          signal: AbortSignal.timeout(5_000),
        }).catch((error: Error) => error);
        const text = res instanceof Response ? await res.text() : "";
        if (res instanceof Response && (res.status === 200 || res.status === 201)) {
          versions.add((JSON.parse(text) as { version: number }).version);
          break;
        }
        if (res instanceof Response && res.status < 500) {
          throw new Error(`PUT /v1/tasks/${TASK} for ${tenant} answered ${res.status}: ${text}`);
        }
        if (attempt === 20) throw new Error(`PUT /v1/tasks/${TASK} for ${tenant} failed 20 times: ${res}`);
        await sleep(250);
      }
    }
  }));
  return versions;
}
const taskPutStarted = performance.now();
const taskVersions = await putTaskEverywhere();
const taskPutS = (performance.now() - taskPutStarted) / 1000;
const taskTenants = new Set(plans.map((p) => p.tenant)).size;

// ---------------------------------------------------------------- clients
const accepted = new Map<string, string>(); // idempotency key -> job id
let submitted = 0, postRequests = 0;
let killing = true;

function document(i: number): string {
  const poison = poisonIndices.has(i) ? ` ${POISON_MARK}: the model hangs on this one.` : "";
  return Array.from(
    { length: 6 },
    (_, s) =>
      `${BODY_WORDS[(i + s) % BODY_WORDS.length]} ${
        BODY_WORDS[(i * 7 + s) % BODY_WORDS.length]
      } changed in period ${s} of job ${i}.`,
  ).join(" ") + poison;
}

/** Run i's ticket: it names its job index, and carries the marker that makes the model's answers bad, if any. */
function ticket(i: number): string {
  const marker = poisonRunIndices.has(i)
    ? ` ${STRUCTURED_MARKERS.breaksAlways}`
    : breaksOnce(i)
    ? ` ${STRUCTURED_MARKERS.breaksOnce}`
    : "";
  const slow = hangsFirst(Math.floor(i / 3), poisonRunIndices.has(i)) ? ` ${HANGS_FIRST_MARK}` : "";
  return `Ticket ${i}: ${document(i)}${marker}${slow}`;
}

/**
 * A 202's job id, or null and whether the API answered at all (a 409 or 5xx) or not (refused, reset, timed out),
 * and whether the answer was a budget's 429 (--budgets: the key was refused).
 */
type PostResult = { jobId: string } | { jobId: null; answered: boolean; refused?: boolean };

/** POSTs from new tenants in flight now (sent, not yet answered): what an aimed API kill cuts off. */
let freshInFlight = 0;
/** When each 202 was answered, and each 503 saying too few replicas acknowledged the job (--sentinel). */
const answered202At: number[] = [], notReplicatedAt: number[] = [];
/** How the API words a 503 for a job too few replicas acknowledged in time (src/runs/http.ts). */
const NOT_REPLICATED = "not yet confirmed on enough replicas";

async function postOnce(
  path: string,
  key: string,
  body: string,
  tenant: string,
  fresh = false,
): Promise<PostResult> {
  postRequests++;
  const apiKey = apiKeys.get(tenant)!;
  const sentAt = performance.now();
  if (fresh) freshInFlight++;
  try {
    const res = await fetch(`http://127.0.0.1:${apiPort}${path}`, {
      method: "POST",
      headers: { authorization: `Bearer ${apiKey}`, "idempotency-key": key, "content-type": "application/json" },
      body,
      signal: AbortSignal.timeout(5_000),
    });
    const text = await res.text();
    if (res.status === 503 && text.includes(NOT_REPLICATED)) notReplicatedAt.push(performance.now());
    if (res.status === 429 && budgetMode?.refusal(tenant, key, sentAt, res, text)) {
      return { jobId: null, answered: true, refused: true };
    }
    if (res.status === 202) {
      answered202At.push(performance.now());
      budgetMode?.acceptedAt(key, performance.now());
      const answer = JSON.parse(text) as { job_id?: string; run_id?: string };
      return { jobId: answer.job_id ?? answer.run_id! };
    }
    if (res.status === 409 || res.status >= 500) return { jobId: null, answered: true }; // retry later, as clients do
    throw new Error(`POST answered ${res.status}: ${text}`);
  } catch (error) {
    if (error instanceof Error && error.message.startsWith("POST answered")) throw error;
    return { jobId: null, answered: false }; // connection refused or reset: the API is restarting
  } finally {
    if (fresh) freshInFlight--;
  }
}

/** Jobs whose result goes to the webhook receiver instead of an email. */
const webhookJobs = new Set<string>();
/** Jobs that are runs of the task, not summaries. */
const runJobs = new Set<string>();

/** One submitted key: its job id as the service derives it (a UUIDv5 of the scope and the body), and its plan. */
interface Submission {
  i: number;
  key: string;
  jobId: string;
  webhook: boolean;
  run: boolean;
  plan: JobPlan;
  /** A run's priority and expiry (priorities.ts). */
  extras?: RunExtras;
  /** When its first POST started (epoch ms). */
  firstPostStartMs: number;
  /** When its last POST so far ended (epoch ms): the job, if taken on, was accepted before. */
  lastPostEndMs: number;
}
const submissions: Submission[] = [];
/** Keys whose client gave up: the only POST got no answer and was never retried (--new-tenants only). */
const abandoned = new Map<string, Submission>();
/** Keys whose 202 named another job than the one the harness derived (the harness's own mistake). */
const misnamed: string[] = [];
/** --budgets: clients refused 429 that come back with their key once the budgets are raised. */
const comeBack: (() => Promise<void>)[] = [];

/** Records a key's 202. */
function accept(s: Submission, jobId: string) {
  if (jobId !== s.jobId) misnamed.push(s.key);
  accepted.set(s.key, jobId);
  if (s.webhook) webhookJobs.add(jobId);
  if (s.run) runJobs.add(jobId);
}

/**
 * Whether a POST's answer is a refusal the client stops at: a budget's 429 before the budgets were raised. Just
 * after the raise the processes may still hold the old limits for up to 2 s: the client tries again, but a 429
 * well after the raise is a failure.
 */
function stopsAt(r: PostResult, key: string): boolean {
  if (r.jobId !== null || !r.refused) return false;
  if (!budgetMode?.raised) return true;
  if (budgetMode.graceOver()) throw new Error(`POST for ${key} answered 429 long after the budgets were raised`);
  return false;
}

/**
 * One logical request: sent, then retried 1-3 times (sometimes concurrently), then until it gets a 202. A client
 * that gives up (--new-tenants) sends once and stops there if that POST got no answer.
 */
async function submit(i: number) {
  const plan = plans[i]!;
  // Padded so that a small --seed still makes a key of the 16 characters the API asks for at least.
  const key = `chaos-${String(SEED).padStart(6, "0")}-${String(i).padStart(6, "0")}`;
  const notify = wantsWebhook(i) ? { webhook: `${receiver.url}/${plan.tenant}` } : `user${i}@example.com`;
  const run = isRun(i);
  // Every run carries a priority, and most an expiry (priorities.ts): the body, and so the job id, says so.
  const extras = run ? runExtras(Math.floor(i / 3), poisonRunIndices.has(i)) : undefined;
  const request = run ? { input: { ticket: ticket(i) }, notify, ...extras } : { text: document(i), notify };
  const path = run ? TASK_RUNS : SUMMARIES;
  const body = JSON.stringify(request);
  const jobIdOf = jobIdFor({ tenant: plan.tenant, method: "POST", path, key }, canonicalJson(request));
  const submission: Submission = {
    i,
    key,
    jobId: jobIdOf,
    webhook: wantsWebhook(i),
    run,
    plan,
    extras,
    firstPostStartMs: Date.now(),
    lastPostEndMs: Date.now(),
  };
  submissions.push(submission);
  const post = () =>
    postOnce(path, key, body, plan.tenant, plan.fresh).finally(() => {
      submission.lastPostEndMs = Math.max(submission.lastPostEndMs, Date.now());
    });
  const results: PostResult[] = [];
  if (!plan.retries && !isPoison(i)) {
    const only = await post();
    if (only.jobId === null && !only.answered) {
      abandoned.set(key, submission);
      submitted++;
      return;
    }
    results.push(only); // answered 409 or 5xx: the client knows it was refused, and tries again below
  } else {
    const copies = 2 + Math.floor(random() * 3); // the first send and 1-3 retries
    const concurrent = random() < 0.3;
    if (concurrent) results.push(...await Promise.all(Array.from({ length: copies }, post)));
    else {
      for (let c = 0; c < copies; c++) {
        results.push(await post());
        if (stopsAt(results.at(-1)!, key)) break;
      }
    }
  }
  let jobId = results.find((r) => r.jobId !== null)?.jobId ?? null;
  let refused = jobId === null && results.some((r) => stopsAt(r, key));
  const end = performance.now() + 120_000;
  for (let delay = 100; jobId === null && !refused && performance.now() < end; delay = Math.min(delay * 2, 1_000)) {
    await sleep(delay + random() * 100);
    const r = await post();
    jobId = r.jobId;
    refused = stopsAt(r, key);
  }
  submitted++;
  if (refused) {
    // Refused, not accepted: half the clients come back with the same key once the budget is raised (nothing
    // of the refusal may stick to the key), half give up (the key must then have left nothing, or, if an
    // earlier POST of it that got no answer was taken in after all, be done once, as an unanswered key is).
    if (!budgetMode!.comesBack()) abandoned.set(key, submission);
    else {
      comeBack.push(async () => {
        for (let delay = 100;; delay = Math.min(delay * 2, 1_000)) {
          const r = await post();
          if (r.jobId !== null) return accept(submission, r.jobId);
          stopsAt(r, key);
          await sleep(delay + random() * 100);
        }
      });
    }
    return;
  }
  if (jobId === null) throw new Error(`POST for ${key} never got a 202 in 120 s`);
  accept(submission, jobId);
}

// ---------------------------------------------------------------- chaos
let kills = 0, workerKills = 0;
/** --new-tenants: API kills, those that cut off new tenants' POSTs in flight, and how many POSTs they cut off. */
let apiKills = 0, apiKillsMidIntake = 0, postsCutOff = 0;
/** How long after a wave of POSTs leaves an aimed API kill may land (uniformly at random). */
const AIM_SPREAD_MS = 40;
/** Resolvers waiting for the next wave of POSTs to leave (--new-tenants). */
const waveWaiters: (() => void)[] = [];
const nextWave = () => new Promise<void>((resolve) => waveWaiters.push(resolve));

/**
 * Waits until the API answers and the next wave of POSTs has left, then up to {@linkcode AIM_SPREAD_MS} more:
 * a kill then lands while many new tenants' first POSTs are being taken in, some of them between the intake
 * script and the lane announce. Bounded, since the waves end before the kill period does.
 */
async function aimAtIntake() {
  await apiUp(10_000).catch(() => {});
  const bound = new AbortController();
  await Promise.race([nextWave(), sleep(3_000, bound.signal).catch(() => {})]);
  bound.abort();
  await sleep(random() * AIM_SPREAD_MS);
}
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

/** With --sentinel: what the failover came to (times are `performance.now()`). */
interface Failover {
  killedPort: number;
  killedAt: number;
  promotedPort: number;
  /** Every sentinel names the new master, and it has taken the role. */
  promotedAt: number;
  /** The API process that was ready before the kill, and was not restarted before it was ready again. */
  apiPid: number;
  /** The first /readyz answer other than 200 after the kill, and the first 200 after that. */
  notReadyAt?: number;
  readyAgainAt?: number;
  /**
   * The new master first lists a replica online (the old primary, synced). Its stream starts with the replica's
   * first acknowledgement, up to a second later: from then on a WAIT can be answered.
   */
  replicaOnlineAt?: number;
  /** The old primary in sync as a replica of the new master, and listed healthy by every sentinel. */
  oldPrimaryBackAt?: number;
}
let failover: Failover | undefined;
/** Why the failover part of a --sentinel run failed, if it did. */
let failoverProblem: string | undefined;

/** One /readyz of the API: its status, or 0 without an answer within 3 s. */
async function readyzStatus(): Promise<number> {
  try {
    const res = await fetch(`http://127.0.0.1:${apiPort}/readyz`, { signal: AbortSignal.timeout(3_000) });
    await res.body?.cancel();
    return res.status;
  } catch {
    return 0;
  }
}

/**
 * --sentinel: SIGKILLs the primary and waits for the promotion, then until the API answers /readyz 200 again.
 * The kill loop awaits this, so no process is killed meanwhile: the API measured is the one that was ready before
 * the kill, never restarted. Each process must have started first: one starting while no master answers exits 1 by
 * design (`Cannot start: ...`), as it would under any supervisor.
 */
async function failOverPrimary(): Promise<void> {
  const bound = new AbortController();
  const allStarted = await Promise.race([
    Promise.all(procs.map((p) => p.started)).then(() => true),
    sleep(20_000, bound.signal).then(() => false, () => false),
  ]);
  bound.abort();
  if (!allStarted) throw new Error(`not every process had logged its start 20 s after the failover was due`);
  for (const end = performance.now() + 10_000; (await readyzStatus()) !== 200; await sleep(100)) {
    if (performance.now() > end) throw new Error("the API's /readyz was not 200 before the primary's kill");
  }
  const api = procs.find((p) => p.task === "api")!;
  let apiExited = false;
  api.child.status.then(() => (apiExited = true));
  const killedPort = await sentinel!.killPrimary();
  const killedAt = performance.now();
  const f: Failover = { killedPort, killedAt, promotedPort: 0, promotedAt: NaN, apiPid: api.child.pid };
  failover = f;
  let deadline = killedAt + 30_000;
  // A poll every 100 ms, each on its own: one held up by a ping that times out (1 s) does not delay the next.
  const watching = (async () => {
    const polls: Promise<void>[] = [];
    while (f.readyAgainAt === undefined && performance.now() < deadline) {
      polls.push(
        readyzStatus().then((status) => {
          if (status !== 200) f.notReadyAt ??= performance.now();
          else if (f.notReadyAt !== undefined) f.readyAgainAt ??= performance.now();
        }),
      );
      await sleep(100);
    }
    await Promise.all(polls);
  })();
  try {
    const promoted = await sentinel!.waitForFailover(20_000);
    f.promotedPort = promoted.port;
    f.promotedAt = killedAt + promoted.afterKillMs;
    deadline = f.promotedAt + READYZ_BOUND_MS;
  } finally {
    deadline = Math.min(deadline, performance.now() + READYZ_BOUND_MS);
    await watching;
  }
  events.push(
    `redis primary :${killedPort} killed (SIGKILL); the sentinels promoted :${f.promotedPort} ${
      seconds(f.promotedAt - killedAt)
    } later`,
  );
  if (apiExited) failoverProblem = `the API process (pid ${f.apiPid}) exited during the failover`;
  else if (f.notReadyAt === undefined) {
    failoverProblem = "the API's /readyz never answered other than 200 after the kill";
  } else if (f.readyAgainAt === undefined) {
    failoverProblem = `the API's /readyz was not 200 again within ${READYZ_BOUND_MS / 1000} s of the promotion`;
  }
}

/** --sentinel: the old primary comes back, from its own files, as a replica of the new master. */
async function bringBackOldPrimary(): Promise<void> {
  const f = failover;
  if (!f) return;
  const restartAt = performance.now();
  // The harness's own client is on the new master. It may list the replica online a moment after the replica
  // reports its link up, which is when the restart is over.
  let giveUpAt = Infinity;
  const online = (async () => {
    while (performance.now() < giveUpAt && f.replicaOnlineAt === undefined) {
      const info = await redisAdmin.info("replication").catch(() => "");
      if (/^slave\d+:.*state=online/m.test(info)) f.replicaOnlineAt = performance.now();
      else await sleep(50);
    }
  })();
  try {
    await sentinel!.restartOldPrimary();
  } catch (error) {
    failoverProblem ??= `the old primary did not come back: ${error}`;
    return;
  } finally {
    giveUpAt = performance.now() + 10_000;
    await online;
  }
  f.oldPrimaryBackAt = performance.now();
  events.push(
    `old primary :${f.killedPort} restarted as a replica of :${f.promotedPort}: online ${
      f.replicaOnlineAt === undefined ? "(not seen)" : seconds(f.replicaOnlineAt - f.killedAt)
    }, listed healthy by the sentinels ${seconds(f.oldPrimaryBackAt - f.killedAt)} after its kill (restart begun ${
      seconds(restartAt - f.killedAt)
    } after)`,
  );
}

const seconds = (ms: number) => `${(ms / 1000).toFixed(1)} s`;

async function killLoop() {
  const end = performance.now() + DURATION_S * 1000;
  const outages = Promise.all([outageLoop(end), deployments?.outages(end, events)]);
  let redisRestarted = !REDIS_RESTART, pgTerminated = !PG_TERMINATE, masterRestarted = !CLUSTER;
  let failedOver = !SENTINEL, oldPrimaryBack = !SENTINEL;
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
    if (pgPair && !pgPair.done && elapsed > 0.5) {
      // No kill lands until the API's /readyz is 200 again: its recovery is measured in one process.
      events.push(await pgPair.failover({ port: apiPort, child: () => procs.find((p) => p.task === "api")!.child }));
      continue;
    }
    if (!failedOver && elapsed > 0.4) {
      failedOver = true;
      await failOverPrimary().catch((error) => (failoverProblem ??= `failover: ${error}`));
      continue;
    }
    if (!oldPrimaryBack && elapsed > 0.6) {
      oldPrimaryBack = true;
      await bringBackOldPrimary();
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
    // With --new-tenants, half the kills are aimed at the API while a wave of POSTs is being taken in.
    const aimed = NEW_TENANTS && random() < 0.5;
    if (aimed) await aimAtIntake();
    const victim = aimed ? procs.find((p) => p.task === "api")! : pick(procs);
    if (victim.task === "api") {
      apiKills++;
      if (freshInFlight > 0) apiKillsMidIntake++;
      postsCutOff += freshInFlight;
    }
    killedByUs.add(victim.child);
    victim.child.kill("SIGKILL");
    await victim.child.status;
    await victim.logged; // its last lines before the replacement's first
    kills++;
    if (victim.task === "worker") workerKills++;
    const replacement = await spawn(victim.name, victim.task);
    procs[procs.indexOf(victim)] = replacement;
  }
  await outages;
  if (!failedOver) failoverProblem = "the kill period ended before the primary's kill was due (raise --duration)";
  // Until it is back, the new master has no replica, and with --replicas-ack 1 intake accepts nothing.
  if (!oldPrimaryBack) await bringBackOldPrimary();
  killing = false;
}

/** The poison documents' and poison runs' job ids (the accepted ones, and those whose intake ran unanswered). */
function poisonJobs(): Set<string> {
  return new Set(submissions.filter((s) => isPoison(s.i)).map((s) => accepted.get(s.key) ?? s.jobId));
}

/** The poison runs' ids: each must fail, and send its failure notification once. */
function poisonRunJobs(): Set<string> {
  return new Set(submissions.filter((s) => poisonRunIndices.has(s.i)).map((s) => accepted.get(s.key) ?? s.jobId));
}

/** How a run ended, which names its notification: done, failed (a poison run) or expired (it set `expires_in`). */
type RunEnd = "done" | "failed" | "expired";

/**
 * The dedupe key of a job's notification (its email's Idempotency-Key, its webhook's webhook-id): a summary's,
 * or a run's as it ended.
 */
function notificationKey(id: string, end: RunEnd = "done"): string {
  const webhook = webhookJobs.has(id);
  if (!runJobs.has(id)) return `${webhook ? SUMMARY_WEBHOOK_KEY_PREFIX : SUMMARY_READY_KEY_PREFIX}${id}`;
  return RUN_KEY_PREFIX[webhook ? "webhook" : "email"][end] + id;
}

/** The jobs decided expired (runs that set `expires_in`). */
async function expiredJobs(): Promise<Set<string>> {
  const rows = await db.sql<{ job_id: string }[]>`
    SELECT job_id::text FROM job_outcomes WHERE outcome = 'expired'`;
  return new Set(rows.map((r) => r.job_id));
}

/** How many poison documents are decided failed. */
async function poisonFailed(): Promise<number> {
  const [row] = await db.sql<{ n: number }[]>`
    SELECT count(*)::int AS n FROM job_outcomes WHERE outcome = 'failed' AND job_id = ANY(${[
    ...poisonJobs(),
  ]}::uuid[])`;
  return row!.n;
}

/** The job id of every dead letter in every lane, one per entry (so a job dead-lettered twice is there twice). */
async function deadLetterJobIds(): Promise<(string | undefined)[] | null> {
  try {
    const lanes = await allLanes(redisAdmin, serviceKeys(KEY_PREFIX));
    const dead = await Promise.all(lanes.map((l) => listDeadLetters(redisAdmin, l.keys, 10_000)));
    return dead.flat().map((d) => d.fields.job_id);
  } catch {
    return null;
  }
}

/** Whether every poison job has its dead letter. */
async function poisonDeadLettered(): Promise<boolean> {
  const ids = new Set(await deadLetterJobIds() ?? []);
  return [...poisonJobs()].every((id) => ids.has(id));
}

/** Summaries, run results and expired runs: the jobs ended as they should. */
async function countDone(): Promise<number> {
  const [row] = await db.sql<{ n: number }[]>`
    SELECT (SELECT count(*) FROM summaries)::int + (SELECT count(*) FROM run_results)::int +
      (SELECT count(*) FROM job_outcomes WHERE outcome = 'expired')::int AS n`;
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

/**
 * --new-tenants: one wave of jobs a second over most of the kill period, every job of a wave submitted at once,
 * so an API kill aimed just after a wave leaves finds many new tenants' first POSTs in flight.
 */
async function submitInWaves() {
  const waves = Math.max(1, Math.floor(DURATION_S * 0.8));
  const perWave = Math.ceil(JOBS / waves);
  await Promise.all(Array.from({ length: waves }, async (_, w) => {
    const due = started + w * 1_000;
    if (due > performance.now()) await sleep(due - performance.now());
    const wave = [];
    for (let i = w * perWave; i < Math.min(JOBS, (w + 1) * perWave); i++) wave.push(submit(i));
    for (const resolve of waveWaiters.splice(0)) resolve();
    await Promise.all(wave);
  }));
}

/** Settles once every client has submitted its job (or stopped at a refusal). */
let submissionsFinished!: () => void;
const submissionsDone = new Promise<void>((resolve) => (submissionsFinished = resolve));

/**
 * --budgets: at RAISE_AT of the kill period, checks the budgeted tenants and raises their budgets; once every
 * client has submitted, the refused clients that come back post their keys again until they get a 202.
 */
async function budgetPhase(): Promise<void> {
  const due = started + RAISE_AT * DURATION_S * 1000;
  if (due > performance.now()) await sleep(due - performance.now());
  const taken = submissions.filter((s) => accepted.has(s.key))
    .map((s) => ({ tenant: s.plan.tenant, jobId: accepted.get(s.key)!, run: s.run }));
  await budgetMode!.raise(taken, poisonJobs());
  await submissionsDone;
  await Promise.all(comeBack.splice(0).map((retry) => retry()));
}

const redisKeys = serviceKeys(KEY_PREFIX);
/** The submissions among `list` whose intake script ran (the job's status record exists) or whose job is done. */
async function intakeRanFor(list: Submission[]): Promise<Submission[]> {
  if (list.length === 0) return [];
  const ids = list.map((s) => s.jobId);
  const done = new Set(
    (await db.sql<{ job_id: string }[]>`
      SELECT job_id::text FROM summaries WHERE job_id = ANY(${ids}::uuid[])
      UNION ALL SELECT run_id::text FROM run_results WHERE run_id = ANY(${ids}::uuid[])
      UNION ALL SELECT job_id::text FROM job_outcomes WHERE outcome = 'expired' AND job_id = ANY(${ids}::uuid[])`)
      .map((r) => r.job_id),
  );
  const records = await Promise.all(list.map((s) => redisAdmin.exists(redisKeys.lane(s.plan.tenant).job(s.jobId))));
  return list.filter((s, n) => done.has(s.jobId) || records[n]! > 0);
}

let failure: unknown;
let drainSeconds = NaN;
try {
  const chaos = killLoop();
  // Its error (if any) is kept until it is awaited, after the submissions.
  const budgetsRaised = budgetMode ? budgetPhase().then(() => undefined, (error: unknown) => ({ error })) : undefined;
  const progress = setInterval(() => {
    countDone().then((n) => (done = n), () => {});
    budgetMode?.poll().catch(() => {});
    drawProgress();
  }, 250);
  try {
    if (NEW_TENANTS) await submitInWaves();
    else {
      // Submit with 16 clients in parallel, spread over most of the kill period; with --budgets, most of the
      // budgeted tenants' jobs at once, as the kill period starts.
      const spacingMs = (DURATION_S * 800) / Math.max(1, JOBS);
      const burst = budgetMode ? burstJobs(plans.map((p) => p.tenant)) : new Set<number>();
      let next = 0;
      await Promise.all([
        ...Array.from({ length: 16 }, async () => {
          while (next < JOBS) {
            const i = next++;
            if (burst.has(i)) continue;
            const due = started + i * spacingMs;
            if (due > performance.now()) await sleep(due - performance.now());
            await submit(i);
          }
        }),
        ...[...burst].map(submit),
      ]);
    }
    submissionsFinished();
    await chaos;
    const budgetError = await budgetsRaised;
    if (budgetError) throw budgetError.error;
    const drainStart = performance.now();
    const end = drainStart + DRAIN_TIMEOUT_S * 1000;
    const expected = new Set(accepted.values());
    while (performance.now() < end) {
      for (const id of poisonJobs()) expected.delete(id);
      for (const s of await intakeRanFor([...abandoned.values()])) {
        expected.add(s.jobId);
        if (s.webhook) webhookJobs.add(s.jobId);
        if (s.run) runJobs.add(s.jobId);
      }
      done = await countDone();
      const expired = await expiredJobs();
      const keys = new Set([...mail.delivered.map((d) => d.idempotencyKey), ...receiver.processed.keys()]);
      const notified = [...expected].every((id) => keys.has(notificationKey(id, expired.has(id) ? "expired" : "done")));
      const poisonNotified = [...poisonRunJobs()].every((id) => keys.has(notificationKey(id, "failed")));
      // A poison job's dead letter may come after its failed outcome (a dead-letter write that failed is done
      // again by a later delivery): the drain waits for both.
      if (
        done >= expected.size && notified && poisonNotified && (await poisonFailed()) === poisonJobs().size &&
        await poisonDeadLettered()
      ) break;
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
// A key whose only POST got no answer names a job the service may or may not have taken on: if its intake ran,
// the job must be done exactly once, like an accepted one; if not, it must have left nothing at all.
const abandonedRan = await intakeRanFor([...abandoned.values()]).catch((): Submission[] => []);
for (const s of abandonedRan) {
  if (s.webhook) webhookJobs.add(s.jobId);
  if (s.run) runJobs.add(s.jobId);
}
const acceptedCount = new Set(accepted.values()).size;
// The poison documents are checked apart: dead-lettered, each once, and never done.
const poison = poisonJobs();
const jobIds = [...new Set([...accepted.values(), ...abandonedRan.map((s) => s.jobId)])].filter((id) =>
  !poison.has(id)
);
const summaries = await db.sql<{ job_id: string }[]>`SELECT job_id::text FROM summaries`;
const runResults = await db.sql<{ run_id: string; output: unknown }[]>`SELECT run_id::text, output FROM run_results`;
const outbox = await db.sql<{ job_id: string; dedupe_key: string }[]>`
  SELECT payload->>'job_id' AS job_id, dedupe_key FROM outbox`;
const summaryIds = new Set(summaries.map((r) => r.job_id));
const runResultIds = new Set(runResults.map((r) => r.run_id));
/** Jobs done: a summary job's summary, or a task run's result. */
const doneIds = new Set([...summaryIds, ...runResultIds]);
/** Runs decided expired: their model call had not started by their expires_in (priorities.ts checks which). */
const expiredIds = await expiredJobs();
/** Jobs ended as a job may: done, or (a run with an expiry) expired. */
const endedIds = new Set([...doneIds, ...expiredIds]);
const lost = [...new Set(accepted.values())].filter((id) => !poison.has(id) && !endedIds.has(id)).length;
// Every job the service took on and never finished, with where it sits: the failure report names each one.
const idOf = (s: Submission) => accepted.get(s.key) ?? s.jobId;
const taken = new Set(jobIds);
const stranded = submissions.filter((s) => taken.has(idOf(s)) && !endedIds.has(idOf(s)));
const strandedReport = await Promise.all(stranded.map(describeStranded)).catch((error) => [`  (${error})`]);
const outboxRows = new Map<string, number>();
for (const r of outbox) outboxRows.set(r.job_id, (outboxRows.get(r.job_id) ?? 0) + 1);
const doneWithoutOutbox = jobIds.filter((id) => endedIds.has(id) && !outboxRows.has(id)).length;
// Poison runs write their failure notification: they were taken on too.
const outboxUnknown = [...outboxRows.keys()].filter((id) => !taken.has(id) && !poison.has(id)).length;
const abandonedDone = abandonedRan.filter((s) => endedIds.has(s.jobId)).length;
const abandonedAbsent = abandoned.size - abandonedRan.length;
const dupSummaries = summaries.length - summaryIds.size;
const dupOutbox = outbox.length - new Set(outbox.map((r) => r.job_id)).size;
const dupOutboxKeys = outbox.length - new Set(outbox.map((r) => r.dedupe_key)).size;
const unexpected = summaries.filter((r) => !taken.has(r.job_id) || runJobs.has(r.job_id)).length;
// Every notification the run must have sent, once each, by its dedupe key: one per job taken on (a run's as it
// ended: done or expired), and one per poison run (its failure); a poison document (a summary) sends none.
const poisonRuns = poisonRunJobs();
/** How a run ended, as its notification must say. */
const endOf = (id: string): RunEnd => poisonRuns.has(id) ? "failed" : expiredIds.has(id) ? "expired" : "done";
const expectedEmailKeys = new Set<string>(), expectedWebhookKeys = new Set<string>();
for (const id of [...jobIds, ...poisonRuns]) {
  (webhookJobs.has(id) ? expectedWebhookKeys : expectedEmailKeys).add(notificationKey(id, endOf(id)));
}
const expectedKeys = new Set([...expectedEmailKeys, ...expectedWebhookKeys]);
const outboxUnexpected = outbox.filter((r) => !expectedKeys.has(r.dedupe_key)).length;
const deliveredKeys = mail.delivered.map((d) => d.idempotencyKey);
const distinctEmails = new Set(deliveredKeys).size;
const dupEmails = deliveredKeys.length - distinctEmails;
const emailsUnexpected = [...new Set(deliveredKeys)].filter((k) => k === null || !expectedEmailKeys.has(k)).length;
const webhookIds = [...receiver.processed.keys()];
// A webhook is right when its webhook-id is an expected notification's and its body names that job.
const webhooksRight = webhookIds.filter((id) => expectedWebhookKeys.has(id) && id.endsWith(receiver.processed.get(id)!))
  .length;

// Task runs: as the `runs` view shows them, with their outcome's reason and their result row.
const runRows = await db.sql<{ run_id: string; task: string; version: number; status: string; error: string | null }[]>`
  SELECT r.run_id::text, r.task, r.version, r.status, o.error
  FROM runs r JOIN job_outcomes o ON o.job_id = r.run_id WHERE r.task <> 'summarize'`;
const runOf = new Map(runRows.map((r) => [r.run_id, r]));
const runsTaken = jobIds.filter((id) => runJobs.has(id));
const runsTakenSet = new Set(runsTaken);
const runsDone = runRows.filter((r) => r.status === "done").length;
const runsFailed = runRows.filter((r) => r.status === "failed").length;
const runsExpired = runRows.filter((r) => r.status === "expired").length;
const submissionOf = new Map(submissions.map((s) => [idOf(s), s]));
/** Runs that set `expires_in`: the only ones that may end expired. */
const mayExpire = (id: string) => submissionOf.get(id)?.extras?.expires_in !== undefined;
// Each run taken on is done (or, with an expiry, expired), as the task's version the PUT made; a poison run
// failed for its output; nothing else.
const runsWrong = runsTaken.filter((id) => {
  const row = runOf.get(id);
  const endedRight = row?.status === "done" || (row?.status === "expired" && mayExpire(id));
  return !endedRight || row.task !== TASK || !taskVersions.has(row.version);
}).length + runRows.filter((r) => !taken.has(r.run_id) && !poisonRuns.has(r.run_id)).length;
// Exactly one result per done run, and none for anything else (summaries, poison runs, expired runs, jobs never
// taken on).
const runResultsWrong = runsTaken.filter((id) => runOf.get(id)?.status === "done" && !runResultIds.has(id)).length +
  runResults.filter((r) => !runsTakenSet.has(r.run_id) || expiredIds.has(r.run_id)).length +
  (runResults.length - runResultIds.size);
// Each output validates against the task's output schema: in its result row, and in its run.completed webhook.
const runWebhooks = receiver.bodies.filter((b) => b.run_id !== undefined);
const invalidOutputs = runResults.filter((r) => outputSchema.validate(r.output).length > 0).length +
  runWebhooks.filter((b) =>
    b.type === "run.completed"
      ? outputSchema.validate(b.output).length > 0
      : b.type !== "run.failed" && b.type !== "run.expired"
  ).length;
/** The type of webhook a run's outcome sends. */
const WEBHOOK_TYPE: Record<RunEnd, string> = { done: "run.completed", failed: "run.failed", expired: "run.expired" };
// Each run's webhook says how it ended: run.expired (status expired) exactly for the runs decided expired.
const webhooksWrongType = runWebhooks.filter((b) => {
  const id = String(b.run_id);
  return b.type !== WEBHOOK_TYPE[endOf(id)] || (b.type === "run.expired" && b.status !== "expired");
}).length;
const indexOf = new Map(submissions.map((s) => [idOf(s), s.i]));
const answersTo = (id: string) => structuredAnswers.get(indexOf.get(id)!) ?? { first: 0, repair: 0 };
const breaksOnceRuns = runsTaken.filter((id) => breaksOnce(indexOf.get(id)!));
// A run whose first answer was not JSON is done only after a repair call's answer (or expired, a short expiry
// reached before its first call started: once that call went out, the repair call goes out too).
const breaksOnceDone = breaksOnceRuns.filter((id) => runOf.get(id)?.status === "done");
const repaired = breaksOnceDone.filter((id) => answersTo(id).repair > 0).length;
// A poison run failed on its output after a first call and a repair call were answered, and said so once.
const deliveredOnce = (key: string) =>
  deliveredKeys.filter((k) => k === key).length + webhookIds.filter((k) => k === key).length === 1;
const poisonRunsFailed = [...poisonRuns].filter((id) => {
  const row = runOf.get(id);
  return row?.status === "failed" && row.error?.includes("output_invalid: ") && answersTo(id).first > 0 &&
    answersTo(id).repair > 0;
}).length;
const poisonRunsNotified = [...poisonRuns].filter((id) => deliveredOnce(notificationKey(id, "failed"))).length;
// An expired run said so once: its run_expired email or run.expired webhook (and, by the checks above, nothing else).
const expiredRuns = runsTaken.filter((id) => expiredIds.has(id));
const expiredNotified = expiredRuns.filter((id) => deliveredOnce(notificationKey(id, "expired"))).length;
const deadIds = await deadLetterJobIds();
const dead = deadIds?.length ?? -1;
const poisonDead = deadIds?.filter((id) => id !== undefined && poison.has(id)).length ?? 0;
// Exactly one dead letter per poison job: a dead-letter write run twice (a resend) would make two of one job.
const deadPerJob = new Map<string, number>();
for (const id of deadIds ?? []) deadPerJob.set(id ?? "(no job id)", (deadPerJob.get(id ?? "(no job id)") ?? 0) + 1);
const poisonDeadOnce = [...poison].filter((id) => deadPerJob.get(id) === 1).length;
const deadTwice = [...deadPerJob.values()].filter((n) => n > 1).length;
const otherDead = dead - poisonDead;
const poisonDone = [...poison].filter((id) => doneIds.has(id)).length;
const poisonDecided = await poisonFailed().catch(() => -1);
// Priorities and expiries: every run taken on, poison runs included.
const plannedRuns: PlannedRun[] = submissions.filter((s) => s.run && (taken.has(idOf(s)) || poisonRuns.has(idOf(s))))
  .map((s) => ({
    id: idOf(s),
    tenant: s.plan.tenant,
    index: s.i,
    extras: s.extras!,
    poison: poisonRunIndices.has(s.i),
    slowStart: hangsFirst(Math.floor(s.i / 3), poisonRunIndices.has(s.i)),
    firstPostStartMs: s.firstPostStartMs,
    lastPostEndMs: s.lastPostEndMs,
  }));
const priorities = await checkPriorities(
  {
    sql: db.sql,
    servers: [model, ...(deployments?.servers() ?? [])],
    jobOf: jobOfRequest,
    startedMark: async (run) => {
      // The run's start decision: when it was let start, or "expired" (never let start).
      const at = await redisAdmin.hget(redisKeys.lane(run.tenant).job(run.id), "started");
      return at === null || at === "expired" ? undefined : Number(at);
    },
  },
  plannedRuns,
).catch((error): { rows: [string, string][]; problems: string[] } => ({
  rows: [],
  problems: [`could not check the priorities and expiries: ${error}`],
}));
await budgetMode?.finish().catch((error) => console.error(`could not read the budgets at the end: ${error}`));
await deployments?.finish(db.sql, model).catch((error) => console.error(`could not read the deployments: ${error}`));

const rows: [string, string][] = [
  ["seed", String(SEED)],
  [
    "mode",
    [
      NEW_TENANTS && "new tenants",
      CLUSTER && "redis cluster",
      SENTINEL && `redis sentinel failover, REDIS_MIN_REPLICAS_ACK=${REPLICAS_ACK}`,
      REDIS_RESTART && "redis restart",
      PG_TERMINATE && "pg_terminate_backend",
      pgPair && `postgres failover (${pgPair.synchronous ? "synchronous" : "asynchronous"} standby)`,
      BUDGETS && "tenant budgets",
      dropProxy && `redis replies dropped (${(100 * REDIS_DROPS).toFixed(1)}%)`,
      deployments?.describe(),
    ]
      .filter(Boolean).join(", ") ||
    "process kills",
  ],
  ["jobs accepted", String(acceptedCount)],
  [
    `task ${TASK} PUT for every tenant (version ${[...taskVersions].join(", ")})`,
    `${taskTenants} tenants in ${taskPutS.toFixed(1)} s`,
  ],
  ...(NEW_TENANTS ? newTenantRows() : []),
  ["POST requests sent (with client retries)", String(postRequests)],
  ["processes killed (SIGKILL), of them workers", `${kills}, ${workerKills}`],
  ["processes that exited on their own", selfExits.length ? selfExits.join(", ") : "0"],
  ...events.map((e): [string, string] => ["infrastructure event", e]),
  ...(pgPair?.rows() ?? []),
  ...(SENTINEL ? sentinelRows() : []),
  ...(budgetMode?.rows() ?? []),
  ["jobs lost (accepted but never done)", String(lost)],
  ["dead-lettered", String(dead)],
  ["poison documents and runs dead-lettered (failed) / expected", `${poisonDead} (${poisonDecided}) / ${poison.size}`],
  ["poison jobs with exactly one dead letter / jobs with more than one", `${poisonDeadOnce} / ${deadTwice}`],
  ["duplicate summaries", String(dupSummaries)],
  ["duplicate outbox rows", String(dupOutbox)],
  ["summaries for jobs never accepted", String(unexpected)],
  [
    `runs of ${TASK} (output schema): taken on / done / failed (poison runs) / expired`,
    `${runsTaken.length + poisonRuns.size} / ${runsDone} / ${runsFailed} (${poisonRuns.size}) / ${runsExpired}`,
  ],
  ...priorities.rows,
  ["runs not done as expected / run results missing, extra or duplicated", `${runsWrong} / ${runResultsWrong}`],
  ["run outputs failing the output schema (results and webhooks)", String(invalidOutputs)],
  ["run webhooks whose type is not the run's outcome", String(webhooksWrongType)],
  [
    "expired runs notified once (run_expired email or run.expired webhook) / expired",
    `${expiredNotified} / ${expiredRuns.length}`,
  ],
  [
    "runs done after a repair call (first answer not JSON) / done / expected (expired)",
    `${repaired} / ${breaksOnceDone.length} / ${breaksOnceRuns.length} (${
      breaksOnceRuns.filter((id) => expiredIds.has(id)).length
    })`,
  ],
  [
    "poison runs failed output_invalid after a repair call / notified once / expected",
    `${poisonRunsFailed} / ${poisonRunsNotified} / ${poisonRuns.size}`,
  ],
  ["duplicate outbox dedupe keys / rows no job should have", `${dupOutboxKeys} / ${outboxUnexpected}`],
  [
    "distinct emails delivered / expected (not expected)",
    `${distinctEmails} / ${expectedEmailKeys.size} (${emailsUnexpected})`,
  ],
  ["emails delivered twice", String(dupEmails)],
  ["distinct webhooks processed / expected", `${webhooksRight} / ${expectedWebhookKeys.size}`],
  ["webhook requests / redeliveries the receiver deduplicated", `${receiver.requests} / ${receiver.redelivered}`],
  ["webhooks failing signature verification", String(receiver.badSignatures)],
  ["send requests / duplicates the provider absorbed", `${mail.requests} / ${mail.deduplicated}`],
  [
    "model calls per job",
    jobIds.length ? ((modelCalls + (deployments?.calls() ?? 0)) / jobIds.length).toFixed(2) : "n/a",
  ],
  ...(deployments?.rows() ?? []),
  ...(dropProxy ? dropRows(dropProxy) : []),
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

/** --redis-drops: what the proxy did to the processes' Redis connections. */
function dropRows(proxy: RedisDropProxy): [string, string][] {
  const s = proxy.stats;
  return [
    [
      `Redis replies dropped with their connection (share ${(100 * REDIS_DROPS).toFixed(1)}%, seed ${SEED}) / passed`,
      `${s.drops} / ${s.replies}`,
    ],
    [
      "commands Redis got whose reply never came back (the dropped one and those pipelined after it)",
      `${s.unanswered}`,
    ],
    ["connections through the proxy (left alone: pub/sub)", `${s.connections} (${s.spared})`],
  ];
}

function newTenantRows(): [string, string][] {
  const freshJobs = plans.filter((p) => p.fresh).length;
  return [
    ["tenants never seen before / their jobs", `${freshTenants.length} / ${freshJobs}`],
    ["time to create every tenant", `${tenantSetupS.toFixed(1)} s`],
    [
      "API kills (SIGKILL) / with new tenants' POSTs in flight (POSTs cut off)",
      `${apiKills} / ${apiKillsMidIntake} (${postsCutOff})`,
    ],
    [
      "POSTs never answered and never retried: done / absent / stranded",
      `${abandonedDone} / ${abandonedAbsent} / ${abandonedRan.length - abandonedDone}`,
    ],
    ["jobs stranded (taken on, never done)", String(stranded.length)],
    ["done jobs without an outbox row", String(doneWithoutOutbox)],
    ["outbox rows for jobs never taken on", String(outboxUnknown)],
  ];
}

function sentinelRows(): [string, string][] {
  const f = failover;
  if (!f) return [["failover", failoverProblem ?? "did not happen"]];
  const after = (at: number | undefined) => (at === undefined ? "never" : seconds(at - f.killedAt));
  const between = (list: number[], from: number, to: number) => list.filter((t) => t >= from && t < to).length;
  const refused = notReplicatedAt.filter((t) => t >= f.killedAt);
  const online = f.replicaOnlineAt ?? Infinity;
  return [
    ["replicas that must acknowledge a job before its 202 (timeout)", `${REPLICAS_ACK} (${ACK_TIMEOUT_MS} ms)`],
    ["permission sets the launcher derived (each naming primary, replica, 3 sentinels)", String(launcherSets)],
    [
      `API /readyz after the primary's kill (pid ${f.apiPid}, not restarted): not ready / ready again`,
      `${after(f.notReadyAt)} / ${after(f.readyAgainAt)} after the kill (${
        f.readyAgainAt === undefined ? "never" : seconds(f.readyAgainAt - f.promotedAt)
      } after the promotion; bound ${READYZ_BOUND_MS / 1000} s)`,
    ],
    [
      "POSTs answered 503 for too few replica acks: before the kill / after it (first, last)",
      `${notReplicatedAt.length - refused.length} / ${refused.length}${
        refused.length ? ` (${after(refused[0])}, ${after(refused.at(-1))} after the kill)` : ""
      }`,
    ],
    [
      "first 202 after the kill / the new master's replica seen online (50 ms polls)",
      `${after(answered202At.find((t) => t >= f.killedAt))} / ${after(f.replicaOnlineAt)} after the kill`,
    ],
    ["202s answered in the second before the kill", String(between(answered202At, f.killedAt - 1_000, f.killedAt))],
    // With acks required no 202 comes before the replica acknowledges, about when the poll sees it online, so a count
    // before that moment would measure only the poll's lag; without them it counts jobs held by one node only.
    ...(REPLICAS_ACK === 0
      ? [[
        "202s answered after the kill before the new master's replica was online (the job on one node only)",
        String(between(answered202At, f.killedAt, online)),
      ] as [string, string]]
      : []),
  ];
}

/** One stranded job: its tenant, how its POST went, its status record, and whether its lane can be found. */
async function describeStranded(s: Submission): Promise<string> {
  const lane = redisKeys.lane(s.plan.tenant);
  const [[status, tenant], known, active, length] = await Promise.all([
    redisAdmin.hmget(lane.job(idOf(s)), "status", "tenant"),
    redisAdmin.sismember(redisKeys.registry.all, s.plan.tenant),
    redisAdmin.sismember(redisKeys.registry.active, s.plan.tenant),
    redisAdmin.xlen(lane.stream),
  ]);
  return `  job ${idOf(s)} of tenant ${s.plan.tenant} (${s.plan.fresh ? "new" : "existing"} tenant, ${
    s.plan.first ? "its first job" : "not its first job"
  }), key ${s.key}: ${accepted.has(s.key) ? "202 received" : "POST never answered, not retried"}; status ${
    // A queued job's record names its tenant and no status (issue 39).
    status ?? (tenant ? "queued" : "(no record)")}; lane ${known ? "in" : "NOT in"} the registry${
    active ? " (active)" : ""
  }, stream length ${length}`;
}

// ---------------------------------------------------------------- clean up
const stoppedCleanly = selfExits.length === 0;
// Each process promises to exit within 10 s of SIGTERM: one that has not after 15 s is SIGKILLed, and fails the run.
const stuck = await stopAll(procs, killedByUs);
await dropProxy?.close();
await model.close();
await deployments?.close();
await mail.close();
await receiver.close();
await redisAdmin.quit().catch(() => redisAdmin.disconnect());
// The shared server's database index, flushed and given back (a no-op for a server of our own).
await releaseRedisDatabase(redisUrl).catch(() => {});
await cluster?.stop();
await sentinel?.stop();
if (ownRedis) {
  ownRedis.child?.kill("SIGKILL");
  await ownRedis.child?.status;
  await Deno.remove(ownRedis.dir, { recursive: true });
}
await db.close();

const ok = !failure && stoppedCleanly && stuck.length === 0 && lost === 0 && dupSummaries === 0 && dupOutbox === 0 &&
  unexpected === 0 &&
  dupEmails === 0 && distinctEmails === expectedEmailKeys.size && emailsUnexpected === 0 &&
  acceptedCount + abandoned.size === JOBS &&
  webhooksRight === expectedWebhookKeys.size && webhookIds.length === expectedWebhookKeys.size &&
  receiver.badSignatures === 0 &&
  runsWrong === 0 && runResultsWrong === 0 && invalidOutputs === 0 && webhooksWrongType === 0 &&
  expiredNotified === expiredRuns.length &&
  repaired === breaksOnceDone.length &&
  breaksOnceDone.length + breaksOnceRuns.filter((id) => expiredIds.has(id)).length === breaksOnceRuns.length &&
  runsDone + runsExpired === runsTaken.length && runsFailed === poisonRuns.size && priorities.problems.length === 0 &&
  poisonRunsFailed === poisonRuns.size && poisonRunsNotified === poisonRuns.size &&
  dupOutboxKeys === 0 && outboxUnexpected === 0 &&
  stranded.length === 0 &&
  poisonDead === poison.size && poisonDecided === poison.size && otherDead === 0 && poisonDone === 0 &&
  poisonDeadOnce === poison.size && deadTwice === 0 && (!dropProxy || dropProxy.stats.drops > 0) &&
  (!NEW_TENANTS || (doneWithoutOutbox === 0 && outboxUnknown === 0 && misnamed.length === 0)) &&
  (pgPair?.ok() ?? true) && (budgetMode?.ok() ?? true) && (deployments?.ok() ?? true) &&
  failoverProblem === undefined;
if (pgPair && !pgPair.ok()) console.error(`chaos run failed: ${pgPair.problem()}`);
if (failure) console.error(`chaos run failed: ${failure instanceof Error ? failure.message : failure}`);
if (failoverProblem) console.error(`sentinel failover: ${failoverProblem}`);
if (dropProxy && dropProxy.stats.drops === 0) {
  console.error("--redis-drops: the proxy dropped no reply (too short a run?)");
}
if (deadTwice > 0) console.error(`${deadTwice} job(s) have more than one dead letter`);
for (const problem of budgetMode?.problems() ?? []) console.error(`budgets: ${problem}`);
for (const problem of deployments?.problems() ?? []) console.error(`deployments: ${problem}`);
for (const problem of priorities.problems) console.error(`priorities and expiries: ${problem}`);
if (stuck.length > 0) console.error(`did not exit within 15 s of SIGTERM (then SIGKILLed): ${stuck.join(", ")}`);
if (stranded.length > 0) {
  const tenants = [...new Set(stranded.map((s) => s.plan.tenant))];
  console.error(
    `STRANDED: ${stranded.length} job(s) taken on and never done, from ${tenants.length} tenant(s) (${
      tenants.join(", ")
    }):\n${strandedReport.join("\n")}`,
  );
}
if (misnamed.length > 0) {
  console.error(
    `the harness derived other job ids than the API answered for ${misnamed.length} key(s), e.g. ${
      misnamed[0]
    }: its checks of unanswered keys cannot be trusted`,
  );
}
if (!ok) {
  console.error(`FAILED: the process logs are in ${logDir}`);
  Deno.exit(1);
}
await Deno.remove(logDir, { recursive: true });
console.log("\nOK: nothing lost, nothing duplicated.");
