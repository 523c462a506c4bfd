/**
 * `deno task chaos:batches`: batch runs (issue 43) through real processes while the workers are SIGKILLed in
 * every window of a batch's life, then every effect counted.
 *
 *   deno task chaos:batches [--runs N] [--max-runs M] [--duration S] [--kills K] [--kill-chance P] [--seed S]
 *                           [--expire-every K] [--drain-timeout S] [--budgets] [--corrupt-budget] [--keep-logs]
 *
 * It starts the API, two workers and a relay as `main.ts` subprocesses with the permission sets their tasks
 * derive, against a scratch Postgres database and an empty Redis database index. `LLM_DEPLOYMENTS` names one
 * deployment, `east`, marked `"batch": true`, serving the model `gpt-batch`: a fake provider on loopback with the
 * Chat Completions endpoint and the Files and Batches API (`tests/support/fake_batch_api.ts`). `LLM_PRICES` gives
 * the model online prices ($2 / $8 per Mtok) and batch prices ($1 / $4). `BATCH_MAX_RUNS` is `--max-runs`
 * (default 100), `BATCH_MAX_WAIT_S=1`, `BATCH_ON_EXPIRY=online`. The mail provider is a fake Resend that fails
 * 10% of sends with a 500.
 *
 * N runs (default 1,000) are POSTed over `--duration` seconds (default N/100, at least 5) by 16 clients, from
 * four tenants, each with `"priority": "batch"`, an Idempotency-Key and an email to notify. One in three are runs
 * of a task PUT for every tenant (`digest`), one in three of a task with an output schema (`triage`: its batch
 * answer goes to a worker to be checked, and one in five of those answers is not JSON, so the worker makes one
 * repair call online), one in three of the built-in `summarize`. Each run's input names it (`of job 17.`), so the
 * online requests can be told apart. A POST that gets no answer, a 409 or a 5xx is sent again with its key; one
 * in five is sent twice anyway, and both answers must name the same run.
 *
 * Each provider batch takes 0.5 to 3 s; every fourth batch created (the 2nd, 6th, ...; `--expire-every K`, 0 for
 * none) ends `expired` with about a third of its lines unfinished (those runs go online), the others complete.
 *
 * Both workers are SIGKILLed together (one of them owns the step) and restarted 200 to 500 ms later, at most
 * `--kills` times (default 3) in each window: the first time the window comes up with no kill under way, then
 * each time with chance `--kill-chance` (default 0.5):
 *
 * - collection: at random times while the runs are being POSTed (0.5 to 2 s after the workers are back, whatever
 *   the chance);
 * - upload: after the fake stored a `POST /v1/files`, before its answer (the file is orphaned, the next worker
 *   uploads again);
 * - creation: after the fake created a `POST /v1/batches`, before its answer: the next worker must find the batch
 *   by its `metadata.oncely_batch`, not create a second;
 * - list: after a page of `GET /v1/batches` (that search) was served;
 * - polling: after a `GET /v1/batches/{id}` that answers an ended batch, before its answer;
 * - commit: after the output file of a batch of 10 lines or more was served, once a random number of its lines
 *   (1 to all but one) are settled, so the kill lands between two lines (a fixed 10-300 ms after the read found a
 *   batch of 12 lines already committed).
 *
 * The report says where each kill aimed at a batch found it once both workers were dead (its state; for a commit
 * kill, how many of its lines were settled).
 *
 * After the last POST it waits for every run to be decided and notified and every batch committed, then checks
 * (any failure exits 1 and names what failed):
 *
 * - every accepted run has exactly one `job_outcomes` row, `done`, and one `run_results` row;
 * - one outbox row, and one email delivered, each (the fake dedupes by Idempotency-Key: deliveries and the
 *   duplicates it absorbed are both counted); no email for anything else;
 * - each run is in the lines of at most one provider batch, no `metadata.oncely_batch` was created twice, and
 *   every provider batch is one of ours, recorded; each provider batch whose create answer a kill cut off is
 *   recorded as its batch's (which only the search by metadata can have done: the answer never arrived);
 * - online model requests name only runs whose line was unfinished in an expired batch, and each of those made
 *   at least one;
 * - each run done through a batch has exactly one `model_attempts` row with `batch_id`, with the usage the
 *   provider reported for its line, and `cost_usd` equal to that usage at the batch prices; a run sent online
 *   has none;
 * - every `batches` row ends `committed`, every `batch_runs` row settled (`committed` or, for the unfinished
 *   lines, `online`); no process exited on its own, and each stopped within 15 s of SIGTERM.
 *
 * With `--budgets`, two tenants post under budgets set by the real `tenant budget` command before the processes
 * start (`batch-a` per day, `batch-b` per month, each in tokens and USD, room for all their runs), so every line
 * holds its worst case from collection until it settles; at the end no hold is left, each budget's spend is its
 * tenant's `model_attempts` rows and the provider's report at batch prices, and no budget was ever passed (see
 * `batch_budgets.ts`, and `--corrupt-budget` for a self-check of those checks).
 */
import { Redis } from "ioredis";
import { sleep } from "../../src/async/timeout.ts";
import { parseConfig } from "../../src/config.ts";
import { costNanos, type ModelPrice } from "../../src/llm/prices.ts";
import { RUN_KEY_PREFIX } from "../../src/runs/shapes.ts";
import { KEY_PREFIX, serviceKeys } from "../../src/runs/keys.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { deploymentsEnv } from "../support/deployments_env.ts";
import type { BatchApiStep, BatchScript, LineOutcome } from "../support/fake_batch_api.ts";
import { startFakeMail } from "../support/fake_mail_server.ts";
import {
  type ChatBody,
  defaultAnswer,
  realisticUsage,
  startFakeModel,
  type Usage,
} from "../support/fake_model_server.ts";
import { freePort } from "../support/free_port.ts";
import { seededRandom } from "../support/random.ts";
import { createScratchDatabase, emptyRedisDatabase, releaseRedisDatabase } from "../support/scratch.ts";
import { apiHealthy, createSpawner, numberOption, type Proc, stopAll, taskArgsOf } from "./_processes.ts";
import { batchBudgets, type BudgetCheck } from "./batch_budgets.ts";

// ---------------------------------------------------------------- options
const args = Deno.args;
const option = (name: string, fallback: number) => numberOption(args, name, fallback);
const RUNS = Math.floor(option("runs", 1000));
const MAX_RUNS = Math.max(1, Math.floor(option("max-runs", 100)));
const DURATION_S = option("duration", Math.max(5, RUNS / 100));
/** The most kills in each window. */
const KILLS = Math.floor(option("kills", 3));
const KILL_CHANCE = option("kill-chance", 0.5);
/** Every this-many-th provider batch (the 2nd, then every K-th after it) expires; 0: none does. */
const EXPIRE_EVERY = Math.max(0, Math.floor(option("expire-every", 4)));
const DRAIN_TIMEOUT_S = option("drain-timeout", 900);
const KEEP_LOGS = args.includes("--keep-logs");
/** A self-check of the budget checks: the budget of `batch-a` is corrupted once the run drained (see batch_budgets.ts). */
const CORRUPT_BUDGET = args.includes("--corrupt-budget");
const BUDGETS = args.includes("--budgets") || CORRUPT_BUDGET;
const SEED = option("seed", Date.now() % 1_000_000);
const random = seededRandom(SEED);
const CLIENTS = 16;

const ADMIN_URL = Deno.env.get("CHAOS_DATABASE_URL") ?? "postgres://postgres@127.0.0.1:5432/postgres";
const logDir = await Deno.makeTempDir({ prefix: "oncely-chaos-batches-" });
const wallStart = performance.now();
const elapsed = () => `${((performance.now() - wallStart) / 1000).toFixed(1)} s`;
const note = (line: string) => Deno.stderr.writeSync(new TextEncoder().encode(`[${elapsed()}] ${line}\n`));

// ---------------------------------------------------------------- the provider
const MODEL = "gpt-batch";
const PRICE: ModelPrice = { in: 2, out: 8, batch_in: 1, batch_out: 4 };
/** What names a run in its input, and so in its line and in any online request for it. */
const JOB_NAMED = /\bof job (\d+)\./;

/** The usage the provider reported for each run's line (by custom_id: the run id). */
const reportedUsage = new Map<string, Usage>();
/** Runs whose line an expired batch left unfinished (by custom_id), with the provider batch's number. */
const unfinishedLines = new Map<string, number>();
/** The job index each online model request named in any of its messages (NaN for one that named none). */
const onlineRequests: number[] = [];
/** When each online model request came (`performance.now()`), by the same index. */
const onlineRequestAt: number[] = [];
/** When each kill of the workers began (`performance.now()`). */
const killedAt: number[] = [];
/** Structured runs whose line answered text that is not JSON (by custom_id): repaired online, once each. */
const brokenAnswers = new Set<string>();
let expiredBatches = 0;

/**
 * Batch `n` (counting the batches created, from 1): 0.5-3 s, and every fourth (the 2nd, 6th, 10th, ...: a run of
 * 50 has one) expires with about a third of its lines unfinished.
 */
function batchScript(n: number): BatchScript {
  const expired = EXPIRE_EVERY > 0 && n % EXPIRE_EVERY === 2 % EXPIRE_EVERY;
  if (expired) expiredBatches++;
  return {
    delayMs: 500 + Math.floor(random() * 2_500),
    end: expired ? "expired" : "completed",
    line: (customId, body): LineOutcome => {
      if (expired && random() < 1 / 3) {
        unfinishedLines.set(customId, n);
        return { kind: "unfinished" };
      }
      // One structured run in five answers text that is not JSON: its worker makes one repair call, online.
      const job = Number(JOB_NAMED.exec(JSON.stringify(body.messages))?.[1]);
      if (body.response_format?.type === "json_schema" && job % 5 === 2) {
        brokenAnswers.add(customId);
        const content = `Not JSON at all, of job ${job}.`;
        const usage = realisticUsage(body, content);
        reportedUsage.set(customId, usage);
        return { kind: "ok", content, usage };
      }
      const content = defaultAnswer(body);
      const usage = realisticUsage(body, content);
      reportedUsage.set(customId, usage);
      return { kind: "ok", content, usage };
    },
  };
}

const model = startFakeModel((n) => {
  // The whole conversation: a repair call's last message is the repair request, which names no job.
  const named = JOB_NAMED.exec(JSON.stringify(model.bodies[n - 1]?.messages ?? []));
  onlineRequests[n - 1] = named ? Number(named[1]) : NaN;
  onlineRequestAt[n - 1] = performance.now();
  return { kind: "ok", usage: "realistic" };
}, { batches: batchScript, afterBatchStep: (event) => afterStep(event) });
const mail = startFakeMail(() => (random() < 0.1 ? { kind: "status", status: 500 } : { kind: "ok" }));

// ---------------------------------------------------------------- Redis, Postgres, tenants
const db = await createScratchDatabase(ADMIN_URL, { prefix: "oncely_chaos_batches" });
const redisUrl = await emptyRedisDatabase(Deno.env.get("CHAOS_REDIS_URL") ?? "redis://127.0.0.1:6379/0");
const redisAdmin = new Redis(redisUrl, { maxRetriesPerRequest: null });
redisAdmin.on("error", () => {});
const TENANTS = ["batch-a", "batch-b", "batch-c", "batch-d"];
const apiKeys = new Map(await Promise.all(TENANTS.map(async (t) => [t, await createApiKey(db.sql, t)] as const)));

// ---------------------------------------------------------------- processes
const apiPort = freePort();
const env: Record<string, string> = {
  DATABASE_URL: db.url,
  REDIS_URL: redisUrl,
  PORT: String(apiPort),
  ...deploymentsEnv([{
    name: "east",
    base_url: model.url,
    api_key_env: "LLM_KEY_EAST",
    models: [MODEL],
    batch: true,
  }]),
  OPENAI_MODEL: MODEL,
  LLM_PRICES: JSON.stringify({ [MODEL]: PRICE }),
  BATCH_MAX_RUNS: String(MAX_RUNS),
  BATCH_MAX_WAIT_S: "1",
  BATCH_ON_EXPIRY: "online",
  RESEND_API_KEY: "re_chaos",
  RESEND_BASE_URL: mail.url,
  IDEMPOTENCY_LOCK_TTL_S: "3",
  // A delivery cut off by a kill is claimed again 2 s later.
  CLAIM_IDLE_MS: "2000",
  WORKER_CONCURRENCY: "16",
  RELAY_BATCH: "10",
  RELAY_MAX_ATTEMPTS: "1000",
  MAIL_SEND_TIMEOUT_S: "1",
  LOG_LEVEL: "info",
  NO_COLOR: "1",
};
const config = parseConfig(env);
const { spawn, killedByUs, selfExits } = createSpawner({ logDir, env, argsOf: (task) => taskArgsOf(task, config) });

/** `main.ts tenant ARGS`, as `deno task tenant` runs it: @returns its output. */
async function tenantCommand(commandArgs: string[]): Promise<string> {
  const out = await new Deno.Command(Deno.execPath(), {
    args: [...taskArgsOf("tenant", config), ...commandArgs],
    env,
    stdout: "piped",
    stderr: "piped",
  }).output();
  const text = (bytes: Uint8Array) => new TextDecoder().decode(bytes).trim();
  if (!out.success) throw new Error(`tenant ${commandArgs.join(" ")} exited ${out.code}: ${text(out.stderr)}`);
  return text(out.stdout);
}
// --budgets: set before any process starts, as an operator would.
const budgetMode = BUDGETS
  ? batchBudgets({
    sql: db.sql,
    redis: redisAdmin,
    keys: serviceKeys(KEY_PREFIX),
    price: PRICE,
    tenantCommand,
    plannedRuns: (tenant) =>
      Array.from({ length: RUNS }, (_, i) => i).filter((i) => TENANTS[i % TENANTS.length] === tenant).length,
  })
  : undefined;
await budgetMode?.setUp();

const procs: Proc[] = [];
for (
  const [name, task] of [["api", "api"], ["worker-1", "worker"], ["worker-2", "worker"], ["relay", "relay"]] as const
) {
  procs.push(await spawn(name, task));
}

// ---------------------------------------------------------------- kills
/** The windows a kill is aimed at. */
const WINDOWS = ["collection", "upload", "create", "list", "poll", "commit"] as const;
type KillWindow = typeof WINDOWS[number];
const kills: Record<KillWindow, number> = { collection: 0, upload: 0, create: 0, list: 0, poll: 0, commit: 0 };
/** What each kill hit, in order, for the report of a failed run. */
const killLog: string[] = [];
/** Set while both workers are down or coming back: no other kill starts meanwhile. */
let episode: Promise<void> | undefined;
/** Set once the run drained: no more kills. */
let killsOver = false;

/**
 * Whether a kill in `window` is due now: under its bound, none under way, and the dice say so (the window's first
 * kill is always due, so a short run has one in every window it reaches).
 */
function killDue(window: KillWindow): boolean {
  if (killsOver || episode !== undefined || kills[window] >= KILLS) return false;
  return kills[window] === 0 || window === "collection" || random() < KILL_CHANCE;
}

/**
 * SIGKILLs both workers (the step's owner is one of them) and restarts them 200-500 ms later. @returns once both
 * are dead; the restart goes on behind (`episode`, until both logged their start).
 */
async function killWorkers(window: KillWindow, what: string, ours?: string): Promise<void> {
  kills[window]++;
  killedAt.push(performance.now());
  const logged = killLog.push(`${elapsed()} ${window}: ${what}`) - 1;
  const victims = procs.filter((p) => p.task === "worker");
  let dead!: () => void;
  const allDead = new Promise<void>((resolve) => (dead = resolve));
  episode = (async () => {
    for (const v of victims) {
      killedByUs.add(v.child);
      v.child.kill("SIGKILL");
    }
    await Promise.all(victims.map((v) => v.child.status));
    dead();
    if (ours !== undefined) {
      const at = await batchAt(ours).catch((error) => `(${error})`);
      landed[window].push(at);
      killLog[logged] += `: our batch ${ours} ${at}`;
    }
    await Promise.all(victims.map((v) => v.logged));
    await sleep(200 + random() * 300);
    const replacements = await Promise.all(victims.map((v) => spawn(v.name, "worker")));
    victims.forEach((v, k) => (procs[procs.indexOf(v)] = replacements[k]!));
    const bound = new AbortController();
    await Promise.race([
      Promise.all(replacements.map((r) => r.started)),
      sleep(30_000, bound.signal).catch(() => {}),
    ]);
    bound.abort();
  })().finally(() => (episode = undefined));
  await allDead;
}

/** Where each kill aimed at a batch found it, by window: its state, and (once ended) its lines settled. */
const landed: Record<KillWindow, string[]> = { collection: [], upload: [], create: [], list: [], poll: [], commit: [] };

/** Our batch `id`'s state as the workers left it, with its lines settled of its lines once it has ended. */
async function batchAt(id: string): Promise<string> {
  const [row] = await db.sql<{ state: string; settled: number; lines: number }[]>`
    SELECT b.state,
      (SELECT count(*) FROM batch_runs r WHERE r.batch_id = b.id AND r.settled IS NOT NULL)::int AS settled,
      (SELECT count(*) FROM batch_runs r WHERE r.batch_id = b.id AND r.in_file)::int AS lines
    FROM batches b WHERE b.id = ${id}::uuid`;
  if (!row) return "(no such batch)";
  return row.state === "ended" || row.state === "committed" ? `${row.state} ${row.settled}/${row.lines}` : row.state;
}

/** Provider batches whose create answer a kill cut off (the worker that asked never learnt their id). */
const cutOffCreates: string[] = [];

/** The fewest lines a batch has for a commit kill to be aimed at it. */
const COMMIT_KILL_LINES = 10;
/** How many lines a provider batch carried. */
const linesOf = (providerBatchId: string | undefined) =>
  model.batches.batches.find((b) => b.id === providerBatchId)?.lines ?? 0;

/** Our batch id of a provider batch (its metadata). */
const oursOf = (providerBatchId: string | undefined) =>
  model.batches.batches.find((b) => b.id === providerBatchId)?.metadata?.oncely_batch;

/** The fake provider's hook: a request's work is done and its answer not yet sent. */
async function afterStep(event: BatchApiStep): Promise<void> {
  switch (event.step) {
    case "upload":
      if (killDue("upload")) {
        const ours = /^oncely-batch-(.+)\.jsonl$/.exec(event.filename)?.[1];
        await killWorkers("upload", `file ${event.fileId} stored (${event.lines} lines)`, ours);
      }
      return;
    case "create":
      if (killDue("create")) {
        cutOffCreates.push(event.batchId);
        await killWorkers("create", `batch ${event.batchId} created`, event.metadata?.oncely_batch);
      }
      return;
    case "list":
      if (killDue("list")) await killWorkers("list", `a page of ${event.batches} batches listed`);
      return;
    case "retrieve":
      if (ENDED.has(event.status) && killDue("poll")) {
        await killWorkers("poll", `batch ${event.batchId} retrieved ${event.status}`, oursOf(event.batchId));
      }
      return;
    case "content": {
      const ours = oursOf(event.batchId), lines = linesOf(event.batchId);
      if (event.file !== "output" || ours === undefined || lines < COMMIT_KILL_LINES || !killDue("commit")) return;
      // The answer goes out now. The kill is aimed between two lines: once a random number of them (1 to all but
      // one) are settled. A fixed delay misses: a batch of a dozen lines commits within 300 ms. Held as the
      // episode meanwhile.
      const target = 1 + Math.floor(random() * (lines - 1));
      let release!: () => void;
      episode = new Promise<void>((resolve) => (release = resolve));
      const served = performance.now();
      settledReach(ours, target).then(async () => {
        episode = undefined;
        if (killsOver) return;
        const waited = Math.round(performance.now() - served);
        await killWorkers("commit", `${waited} ms after batch ${event.batchId}'s output was read`, ours);
      }).finally(release);
    }
  }
}

/** Settles once `target` lines of our batch `id` are settled (polled every 5 ms), or after 5 s. */
async function settledReach(id: string, target: number): Promise<void> {
  for (const end = performance.now() + 5_000; performance.now() < end; await sleep(5)) {
    const [row] = await db.sql<{ settled: number }[]>`
      SELECT count(*)::int AS settled FROM batch_runs WHERE batch_id = ${id}::uuid AND settled IS NOT NULL`;
    if (row!.settled >= target) return;
  }
}
const ENDED = new Set(["completed", "expired", "cancelled", "failed"]);

/**
 * Collection: kills at random times while the runs are being POSTed (0.5 to 2 s after the last one was over, or
 * as soon after as no other kill is under way), until `posted` aborts.
 */
async function collectionKills(posted: AbortSignal) {
  while (!posted.aborted && kills.collection < KILLS) {
    await sleep(500 + random() * 1_500, posted).catch(() => {});
    while (!posted.aborted && episode !== undefined) await episode;
    if (!posted.aborted && killDue("collection")) {
      await killWorkers("collection", `${submissions.length} runs POSTed`);
      await episode;
    }
  }
}

// ---------------------------------------------------------------- the task and the clients
const TASK = "digest";
/** A task with an output schema: its batch answers are checked, and repaired online once, by a worker. */
const STRUCTURED = "triage";
const TRIAGE = {
  prompt: "Label this note: billing, bug or other.\n\n{{input.note}}",
  input_schema: {
    type: "object",
    properties: { note: { type: "string", minLength: 1 } },
    required: ["note"],
    additionalProperties: false,
  },
  output_schema: {
    type: "object",
    properties: { label: { type: "string", enum: ["billing", "bug", "other"] } },
    required: ["label"],
    additionalProperties: false,
  },
};
const DIGEST = {
  prompt: "Summarise this note in one sentence.\n\n{{input.note}}",
  input_schema: {
    type: "object",
    properties: { note: { type: "string", minLength: 1 } },
    required: ["note"],
    additionalProperties: false,
  },
};
const WORDS = "revenue costs growth board plan quarter market customer contract region team".split(" ");

/** Run i's document: several sentences, each naming the run. */
function document(i: number): string {
  return Array.from(
    { length: 4 },
    (_, s) =>
      `The ${WORDS[(i + s) % WORDS.length]} ${WORDS[(i * 7 + s) % WORDS.length]} moved in period ${s} of job ${i}.`,
  ).join(" ");
}

/** Runs i of the built-in summarize (one in three), of the task `digest`, or of the structured task `triage`. */
const isSummarize = (i: number) => i % 3 === 0;
const isStructured = (i: number) => i % 3 === 2;
const taskOf = (i: number) => (isSummarize(i) ? "summarize" : isStructured(i) ? STRUCTURED : TASK);

/** PUTs the task for `tenant` (identical PUTs answer 200: one that got no answer is sent again). */
async function putTask(tenant: string, name = TASK, definition: unknown = DIGEST) {
  for (let attempt = 1;; attempt++) {
    const res = await fetch(`http://127.0.0.1:${apiPort}/v1/tasks/${name}`, {
      method: "PUT",
      headers: { authorization: `Bearer ${apiKeys.get(tenant)}`, "content-type": "application/json" },
      body: JSON.stringify(definition),
      signal: AbortSignal.timeout(5_000),
    }).catch((error: Error) => error);
    const text = res instanceof Response ? await res.text() : String(res);
    if (res instanceof Response && (res.status === 200 || res.status === 201)) return;
    if ((res instanceof Response && res.status < 500) || attempt === 20) {
      throw new Error(`PUT /v1/tasks/${name} for ${tenant} failed: ${text}`);
    }
    await sleep(250);
  }
}

/** One run as submitted: its key and, once accepted, its id. */
interface Submission {
  i: number;
  tenant: string;
  key: string;
  runId?: string;
}
const submissions: Submission[] = [];
let postRequests = 0;
/** Keys whose answers named two different runs (a replay that is not one). */
const replayMismatches: string[] = [];

/** One POST: the run id of a 202, or null after a connection error, a 409 or a 5xx (sent again). */
async function postOnce(path: string, s: Submission, body: string): Promise<string | null> {
  postRequests++;
  try {
    const res = await fetch(`http://127.0.0.1:${apiPort}${path}`, {
      method: "POST",
      headers: {
        authorization: `Bearer ${apiKeys.get(s.tenant)}`,
        "idempotency-key": s.key,
        "content-type": "application/json",
      },
      body,
      signal: AbortSignal.timeout(5_000),
    });
    const text = await res.text();
    if (res.status === 202) return (JSON.parse(text) as { run_id: string }).run_id;
    if (res.status === 409 || res.status >= 500) return null;
    throw new Error(`POST ${path} for ${s.key} answered ${res.status}: ${text}`);
  } catch (error) {
    if (error instanceof Error && error.message.startsWith("POST ")) throw error;
    return null;
  }
}

/** Submits run i until a 202 (sent again with its key after no answer, a 409 or a 5xx; one in five twice). */
async function submit(i: number): Promise<void> {
  const s: Submission = {
    i,
    tenant: TENANTS[i % TENANTS.length]!,
    key: `batch-chaos-${String(SEED).padStart(6, "0")}-${String(i).padStart(6, "0")}`,
  };
  submissions.push(s);
  const path = `/v1/tasks/${taskOf(i)}/runs`;
  const input = isSummarize(i) ? { text: document(i) } : { note: document(i) };
  const body = JSON.stringify({ input, notify: `user${i}@example.com`, priority: "batch" });
  const end = performance.now() + 120_000;
  let runId: string | null = null;
  for (let delay = 100; runId === null; delay = Math.min(delay * 2, 1_000)) {
    runId = await postOnce(path, s, body);
    if (runId === null) {
      if (performance.now() > end) throw new Error(`POST for ${s.key} got no 202 in 120 s`);
      await sleep(delay + random() * 100);
    }
  }
  if (random() < 0.2) {
    const again = await postOnce(path, s, body);
    if (again !== null && again !== runId) replayMismatches.push(s.key);
  }
  s.runId = runId;
}

// ---------------------------------------------------------------- the run
const accepted = () => submissions.filter((s) => s.runId !== undefined).map((s) => s.runId!);
const emailKey = (runId: string) => RUN_KEY_PREFIX.email.done + runId;

/** Whether everything has settled: each run decided and notified, each batch committed. */
async function drained(ids: string[]): Promise<{ done: boolean; line: string }> {
  const [row] = await db.sql<{ decided: number; batches: number; unfinished: number }[]>`
    SELECT (SELECT count(*) FROM job_outcomes WHERE job_id = ANY(${ids}::uuid[]))::int AS decided,
      (SELECT count(*) FROM batches)::int AS batches,
      (SELECT count(*) FROM batches WHERE state <> 'committed')::int AS unfinished`;
  const delivered = new Set(mail.delivered.map((d) => d.idempotencyKey));
  const notified = ids.filter((id) => delivered.has(emailKey(id))).length;
  const { decided, batches, unfinished } = row!;
  return {
    done: decided === ids.length && notified === ids.length && unfinished === 0,
    line: `decided ${decided}/${ids.length}, emailed ${notified}, batches ${batches - unfinished}/${batches} ` +
      `committed, provider batches ${model.batches.counts.creates}, kills ${
        Object.values(kills).reduce((a, b) => a + b, 0)
      }`,
  };
}

let failure: unknown;
let lastPostS = NaN, drainS = NaN;
try {
  await apiHealthy(apiPort, 30_000, logDir);
  // Bounded: a process that dies at start-up would otherwise hold the run until CI's own limit.
  const startBound = new AbortController();
  await Promise.race([
    Promise.all(procs.map((p) => p.started)).finally(() => startBound.abort()),
    sleep(60_000, startBound.signal).then(() => {
      throw new Error("a process did not start within 60 s (see its log)");
    }, () => {}),
  ]);
  await Promise.all(TENANTS.flatMap((t) => [putTask(t), putTask(t, STRUCTURED, TRIAGE)]));
  note(`${RUNS} batch runs over ${DURATION_S} s, BATCH_MAX_RUNS=${MAX_RUNS}, seed ${SEED}; logs in ${logDir}`);
  const posted = new AbortController();
  const collecting = collectionKills(posted.signal);
  const postStart = performance.now();
  const spacingMs = (DURATION_S * 1000) / Math.max(1, RUNS);
  let next = 0;
  const progress = setInterval(() => {
    drained(accepted()).then(({ line }) => note(`submitted ${submissions.length}/${RUNS}; ${line}`), () => {});
  }, 5_000);
  // --budgets: each budget sampled every 250 ms until the run drained (one sample at a time).
  let sampling: Promise<void> | undefined;
  const sampler = setInterval(() => {
    if (budgetMode && !sampling) {
      sampling = budgetMode.sample().catch((error) => void note(`budget sample failed: ${error}`)).finally(() => {
        sampling = undefined;
      });
    }
  }, 250);
  try {
    await Promise.all(Array.from({ length: CLIENTS }, async () => {
      while (next < RUNS) {
        const i = next++;
        const due = postStart + i * spacingMs;
        if (due > performance.now()) await sleep(due - performance.now());
        await submit(i);
      }
    }));
    posted.abort();
    const lastPost = performance.now();
    lastPostS = (lastPost - postStart) / 1000;
    await collecting;
    const ids = accepted();
    const end = lastPost + DRAIN_TIMEOUT_S * 1000;
    for (;;) {
      const state = await drained(ids);
      if (state.done) break;
      if (performance.now() > end) {
        throw new Error(`not drained ${DRAIN_TIMEOUT_S} s after the last POST: ${state.line}`);
      }
      await sleep(500);
    }
    drainS = (performance.now() - lastPost) / 1000;
    killsOver = true;
    await episode;
    // Late effects (a second email, a stray online call) would show within a moment.
    await sleep(2_000);
  } finally {
    killsOver = true;
    clearInterval(progress);
    clearInterval(sampler);
    await sampling;
  }
  if (CORRUPT_BUDGET) await budgetMode!.corrupt();
} catch (error) {
  failure = error;
}

// ---------------------------------------------------------------- checks
const problems: string[] = [];
const check = (ok: boolean, problem: string) => ok || problems.push(problem);
if (failure) problems.push(`the run did not finish: ${failure instanceof Error ? failure.message : failure}`);

const ids = accepted();
const idSet = new Set(ids);
const indexOf = new Map(submissions.filter((s) => s.runId).map((s) => [s.runId!, s.i]));
const runOfIndex = new Map(submissions.filter((s) => s.runId).map((s) => [s.i, s.runId!]));
check(ids.length === RUNS, `${RUNS - ids.length} of ${RUNS} runs were never accepted`);
check(new Set(ids).size === ids.length, "two keys were answered with the same run id");
check(replayMismatches.length === 0, `replays named another run: ${replayMismatches.slice(0, 5).join(", ")}`);

/** Counts of `rows` by `key`. */
function countBy<T>(rows: readonly T[], key: (row: T) => string): Map<string, number> {
  const counts = new Map<string, number>();
  for (const r of rows) counts.set(key(r), (counts.get(key(r)) ?? 0) + 1);
  return counts;
}
/** `ids` whose count in `counts` is not `n`, with a few named. */
function notExactly(counts: Map<string, number>, n: number, what: string) {
  const wrong = ids.filter((id) => (counts.get(id) ?? 0) !== n);
  check(
    wrong.length === 0,
    `${wrong.length} run(s) with other than ${n} ${what}, e.g. ${
      wrong.slice(0, 3).map((id) => `${id} (${counts.get(id) ?? 0})`).join(", ")
    }`,
  );
  return wrong.length;
}

const outcomes = await db.sql<{ job_id: string; outcome: string }[]>`SELECT job_id::text, outcome FROM job_outcomes`;
const results = await db.sql<{ run_id: string }[]>`SELECT run_id::text FROM run_results`;
const outbox = await db.sql<{ job_id: string; dedupe_key: string }[]>`
  SELECT payload->>'job_id' AS job_id, dedupe_key FROM outbox`;
const attempts = await db.sql<
  {
    job_id: string;
    batch_id: string | null;
    prompt_tokens: number | null;
    completion_tokens: number | null;
    cost_usd: string | null;
  }[]
>`SELECT job_id::text, batch_id::text, prompt_tokens, completion_tokens, cost_usd::text FROM model_attempts`;
const batchRows = await db.sql<{ id: string; state: string; runs: number; provider_batch_id: string | null }[]>`
  SELECT id::text, state, runs, provider_batch_id FROM batches`;
const batchRuns = await db.sql<{ run_id: string; batch_id: string; in_file: boolean | null; settled: string | null }[]>`
  SELECT run_id::text, batch_id::text, in_file, settled FROM batch_runs`;
const settledAsOf = (id: string) => batchRuns.find((r) => r.run_id === id)?.settled;

// Each run done once, with one result, one outbox row and one email.
const done = outcomes.filter((o) => o.outcome === "done");
const wrongOutcomes = notExactly(countBy(outcomes, (o) => o.job_id), 1, "job_outcomes rows") +
  notExactly(countBy(done, (o) => o.job_id), 1, "done outcomes");
check(outcomes.every((o) => idSet.has(o.job_id)), "job_outcomes rows for runs never accepted");
const wrongResults = notExactly(countBy(results, (r) => r.run_id), 1, "run_results rows");
const wrongOutbox = notExactly(countBy(outbox, (r) => r.job_id), 1, "outbox rows");
check(outbox.every((r) => r.dedupe_key === emailKey(r.job_id)), "outbox rows other than a run_done email");
const deliveredKeys = mail.delivered.map((d) => d.idempotencyKey ?? "(none)");
const deliveries = countBy(deliveredKeys, (k) => k);
const emailedTwice = [...deliveries.values()].filter((n) => n > 1).length;
const expectedKeys = new Set(ids.map(emailKey));
const emailsUnexpected = [...deliveries.keys()].filter((k) => !expectedKeys.has(k)).length;
const notEmailed = ids.filter((id) => !deliveries.has(emailKey(id))).length;
check(emailedTwice === 0, `${emailedTwice} email(s) delivered more than once`);
check(notEmailed === 0, `${notEmailed} run(s) never emailed`);
check(emailsUnexpected === 0, `${emailsUnexpected} email(s) for no run`);

// Each run in at most one provider batch; no batch of ours created twice; every provider batch recorded.
const providerBatches = model.batches.batches;
const linesOfRun = countBy(providerBatches.flatMap((b) => [...b.customIds]), (id) => id);
const sentTwice = [...linesOfRun.entries()].filter(([, n]) => n > 1);
check(sentTwice.length === 0, `${sentTwice.length} run(s) sent in more than one provider batch`);
const createdFor = countBy(providerBatches, (b) => b.metadata?.oncely_batch ?? "(no metadata)");
const createdTwice = [...createdFor.entries()].filter(([, n]) => n > 1);
check(
  createdTwice.length === 0,
  `${createdTwice.length} batch(es) of ours created more than once at the provider: ${
    createdTwice.map(([id, n]) => `${id} x${n}`).join(", ")
  }`,
);
const recorded = new Map(batchRows.map((b) => [b.id, b]));
const unrecorded = providerBatches.filter((b) =>
  recorded.get(b.metadata?.oncely_batch ?? "")?.provider_batch_id !== b.id
);
check(unrecorded.length === 0, `${unrecorded.length} provider batch(es) not recorded as their batch's`);
// A batch whose create answer was cut off can be recorded only by the search for its metadata.
const recordedIds = new Set(batchRows.map((b) => b.provider_batch_id));
const foundAgain = cutOffCreates.filter((id) => recordedIds.has(id)).length;
check(
  foundAgain === cutOffCreates.length,
  `${cutOffCreates.length - foundAgain} provider batch(es) whose create answer was cut off never recorded`,
);
const inFile = batchRuns.filter((r) => r.in_file);
check(inFile.every((r) => linesOfRun.get(r.run_id) === 1), "runs in a batch's file that no provider batch carried");
check(batchRuns.every((r) => idSet.has(r.run_id)), "batch_runs rows for runs never accepted");

// Online calls only for the lines an expired batch left unfinished (each of those called), and one repair call
// for each structured run whose line answered text that is not JSON.
const onlineRuns = new Set(batchRuns.filter((r) => r.settled === "online").map((r) => r.run_id));
const structuredIds = new Set(ids.filter((id) => isStructured(indexOf.get(id)!)));
// A structured run whose line answered goes to a worker with its answer (settled `online`), no call unless a repair.
const checkedByWorker = new Set(
  [...structuredIds].filter((id) => settledAsOf(id) === "online" && !unfinishedLines.has(id)),
);
const repaired = new Set([...brokenAnswers].filter((id) => !unfinishedLines.has(id)));
const unattributed = onlineRequests.filter((i) => !runOfIndex.has(i)).length;
const calledOnline = countBy(
  onlineRequests.filter((i) => runOfIndex.has(i)).map((i) => runOfIndex.get(i)!),
  (id) => id,
);
const onlineNotUnfinished = [...calledOnline.keys()].filter((id) => !unfinishedLines.has(id) && !repaired.has(id));
const unfinishedNotCalled = [...unfinishedLines.keys()].filter((id) => !calledOnline.has(id));
// A repair call is made again only when a kill cut the delivery that made it short (its answer died with the
// worker, so the next delivery must ask again): between each two of a run's repair calls, a kill.
const repairTimes = new Map<string, number[]>();
onlineRequests.forEach((job, i) => {
  const id = runOfIndex.get(job);
  if (id !== undefined && repaired.has(id)) repairTimes.set(id, [...repairTimes.get(id) ?? [], onlineRequestAt[i]!]);
});
const cutShort = (id: string) => {
  const times = (repairTimes.get(id) ?? []).sort((a, b) => a - b);
  return times.every((t, i) => i === 0 || killedAt.some((k) => k >= times[i - 1]! && k < t));
};
const repairsNotOnce = [...repaired].filter((id) => calledOnline.get(id) === undefined || !cutShort(id));
const repairsRepeated = [...repaired].filter((id) => (calledOnline.get(id) ?? 0) > 1 && cutShort(id)).length;
check(unattributed === 0, `${unattributed} online model request(s) named no run`);
check(
  onlineNotUnfinished.length === 0,
  `${onlineNotUnfinished.length} run(s) called online though no expired batch left their line unfinished and no ` +
    `repair was due, e.g. job ${indexOf.get(onlineNotUnfinished[0] ?? "")}`,
);
check(unfinishedNotCalled.length === 0, `${unfinishedNotCalled.length} unfinished line(s) whose run never went online`);
check(
  repairsNotOnce.length === 0,
  `${repairsNotOnce.length} broken structured answer(s) not repaired by one call (one more only after a kill cut the ` +
    `delivery that made it short)`,
);
check(
  onlineRuns.size === unfinishedLines.size + checkedByWorker.size &&
    [...onlineRuns].every((id) => unfinishedLines.has(id) || checkedByWorker.has(id)),
  `runs settled online (${onlineRuns.size}) are not the unfinished lines (${unfinishedLines.size}) and the ` +
    `structured answers a worker checked (${checkedByWorker.size})`,
);
check(
  [...structuredIds].every((id) => unfinishedLines.has(id) || checkedByWorker.has(id)),
  "structured runs whose answered line was committed without a worker's check",
);
const structuredOutputs = await db.sql<{ output: { label?: unknown } | null }[]>`
  SELECT output FROM run_results WHERE run_id = ANY(${[...structuredIds]}::uuid[])`;
const badOutputs = structuredOutputs.filter((r) => !["billing", "bug", "other"].includes(String(r.output?.label)));
check(badOutputs.length === 0, `${badOutputs.length} structured result(s) not valid against the output schema`);

// Usage at batch prices: one batch row per run done through a batch, as the provider reported it.
const batchAttempts = attempts.filter((a) => a.batch_id !== null);
const batchRowsOf = countBy(batchAttempts, (a) => a.job_id);
const settledAs = new Map(batchRuns.map((r) => [r.run_id, r.settled]));
const throughBatch = ids.filter((id) => settledAs.get(id) === "committed" || checkedByWorker.has(id));
const wrongUsageRows = throughBatch.filter((id) => batchRowsOf.get(id) !== 1).length +
  [...unfinishedLines.keys()].filter((id) => batchRowsOf.has(id)).length;
check(wrongUsageRows === 0, `${wrongUsageRows} run(s) without exactly one batch usage row (or online with one)`);
let batchNanos = 0, onlineEquivalentNanos = 0, mispriced = 0, misreported = 0;
for (const a of batchAttempts) {
  const prompt = a.prompt_tokens ?? 0, completion = a.completion_tokens ?? 0;
  const reported = reportedUsage.get(a.job_id);
  if (!reported || reported.prompt_tokens !== prompt || reported.completion_tokens !== completion) misreported++;
  const want = costNanos(PRICE, prompt, completion, true);
  const got = a.cost_usd === null ? NaN : Math.round(Number(a.cost_usd) * 1e9);
  if (got !== want) mispriced++;
  batchNanos += Number.isFinite(got) ? got : 0;
  onlineEquivalentNanos += costNanos(PRICE, prompt, completion);
}
check(misreported === 0, `${misreported} batch usage row(s) whose tokens are not the provider's report`);
check(mispriced === 0, `${mispriced} batch usage row(s) not priced at the batch prices`);
const onlineAttempts = attempts.filter((a) => a.batch_id === null);
check(
  onlineAttempts.every((a) => unfinishedLines.has(a.job_id) || repaired.has(a.job_id)),
  "online usage rows for runs that were neither left unfinished nor repaired",
);
const onlineNanos = onlineAttempts.reduce(
  (sum, a) => sum + costNanos(PRICE, a.prompt_tokens ?? 0, a.completion_tokens ?? 0),
  0,
);

// Every batch committed, every line settled.
const notCommitted = batchRows.filter((b) => b.state !== "committed");
check(notCommitted.length === 0, `${notCommitted.length} batch(es) not committed: ${notCommitted.map((b) => b.state)}`);
const unsettled = batchRuns.filter((r) => r.settled === null);
check(unsettled.length === 0, `${unsettled.length} batch_runs row(s) never settled`);
const settledOtherwise = batchRuns.filter((r) => r.settled !== null && !["committed", "online"].includes(r.settled));
check(settledOtherwise.length === 0, `${settledOtherwise.length} line(s) settled failed or left out`);
const notBatched = ids.filter((id) => !settledAs.has(id)).length;
check(notBatched === 0, `${notBatched} run(s) never recorded into a batch (ran online as low)`);

// --budgets: no hold left, spend = the record = the provider's report, no budget passed (batch_budgets.ts).
if (budgetMode) {
  try {
    await budgetMode.finish({
      runsOf: (tenant) => submissions.filter((s) => s.tenant === tenant && s.runId).map((s) => s.runId!),
      reported: reportedUsage,
      online: onlineRequests.map((job, i) => ({
        n: i + 1,
        runId: runOfIndex.get(job),
        job,
        body: model.bodies[i] as ChatBody,
        usage: model.usages[i],
      })),
      wentOnline: (id) => unfinishedLines.has(id) || repaired.has(id),
    });
  } catch (error) {
    problems.push(`the budgets could not be checked: ${error instanceof Error ? error.message : error}`);
  }
  const found = budgetMode.problems();
  if (CORRUPT_BUDGET) {
    // The self-check: each of the three checks must have failed on the corrupted budget, and nothing else.
    const expected: BudgetCheck[] = ["holds", "spend", "limit"];
    for (const { check: kind, problem } of found) console.log(`expected (--corrupt-budget), ${kind}: ${problem}`);
    const missed = expected.filter((kind) => !found.some((f) => f.check === kind && f.problem.startsWith("batch-a:")));
    check(missed.length === 0, `--corrupt-budget: the ${missed.join(", ")} check(s) did not catch the corruption`);
    const other = found.filter((f) => !f.problem.startsWith("batch-a:") || f.check === "other");
    for (const f of other) problems.push(`budgets: ${f.problem}`);
  } else {
    for (const f of found) problems.push(`budgets: ${f.problem}`);
  }
}

// ---------------------------------------------------------------- clean up
const stuck = await stopAll(procs, killedByUs);
check(selfExits.length === 0, `processes exited on their own: ${selfExits.join(", ")}`);
check(stuck.length === 0, `did not exit within 15 s of SIGTERM (then SIGKILLed): ${stuck.join(", ")}`);
await model.close();
await mail.close();
await redisAdmin.quit().catch(() => redisAdmin.disconnect());
await releaseRedisDatabase(redisUrl).catch(() => {});
// A failed run keeps its database for a post-mortem (dropped by the next `DROP DATABASE`, by hand).
if (problems.length > 0) await db.sql.end({ timeout: 1 });
else await db.close();

// ---------------------------------------------------------------- report
const usd = (nanos: number) => `$${(nanos / 1e9).toFixed(6)}`;
const uploads = model.batches.counts.uploads;
const rows: [string, string][] = [
  ["seed", String(SEED)],
  [
    "runs accepted (task digest / structured task triage / built-in summarize)",
    `${ids.length} (${ids.filter((id) => taskOf(indexOf.get(id)!) === TASK).length} / ${structuredIds.size} / ${
      ids.filter((id) => isSummarize(indexOf.get(id)!)).length
    })`,
  ],
  ["POST requests sent (with retries and replays)", String(postRequests)],
  ["BATCH_MAX_RUNS / BATCH_MAX_WAIT_S", `${MAX_RUNS} / 1`],
  ["batches (ours) / committed", `${batchRows.length} / ${batchRows.length - notCommitted.length}`],
  [
    "provider batches created / of ours created twice / lines sent / runs sent twice",
    `${providerBatches.length} / ${createdTwice.length} / ${model.batches.linesSent} / ${sentTwice.length}`,
  ],
  ["uploads (input files orphaned by a kill)", `${uploads} (${uploads - providerBatches.length})`],
  [
    "provider batches whose create answer a kill cut off / recorded (found again by metadata)",
    `${cutOffCreates.length} / ${foundAgain}`,
  ],
  [
    "workers SIGKILLed (both each time): collection / upload / create / list / poll / commit",
    WINDOWS.map((w) => kills[w]).join(" / "),
  ],
  ...(["upload", "create", "poll", "commit"] as const).map((w): [string, string] => [
    `our batch as the ${w} kills left it${w === "commit" ? " (lines settled / lines)" : ""}`,
    landed[w].join(", ") || "-",
  ]),
  [
    "expired batches / lines left unfinished / runs sent online / online model calls",
    `${expiredBatches} / ${unfinishedLines.size} / ${onlineRuns.size} / ${onlineRequests.length}`,
  ],
  [
    "structured runs: answers checked by a worker / of them repaired online (one call each; again after a kill) / " +
    "results invalid",
    `${checkedByWorker.size} / ${repaired.size} (${repairsRepeated}) / ${badOutputs.length}`,
  ],
  [
    "runs done: through a batch / online",
    `${throughBatch.length} / ${[...unfinishedLines.keys()].filter((id) => idSet.has(id)).length}`,
  ],
  [
    "runs with other than one done outcome / result / outbox row",
    `${wrongOutcomes} / ${wrongResults} / ${wrongOutbox}`,
  ],
  [
    "emails: distinct delivered / expected; delivered twice; not expected",
    `${deliveries.size} / ${ids.length}; ${emailedTwice}; ${emailsUnexpected}`,
  ],
  ["send requests / duplicates the mail provider absorbed", `${mail.requests} / ${mail.deduplicated}`],
  ["batch usage rows: mispriced / tokens not as reported", `${mispriced} / ${misreported}`],
  [
    "batch lines at batch prices / the same tokens at online prices",
    `${usd(batchNanos)} / ${usd(onlineEquivalentNanos)}`,
  ],
  ["online calls (expired lines, repairs) at online prices", usd(onlineNanos)],
  ...(budgetMode?.rows() ?? []),
  ["POSTs took / from the last POST to drained", `${lastPostS.toFixed(1)} s / ${drainS.toFixed(1)} s`],
  ["wall time", elapsed()],
];
console.log("\n| batch chaos run | result |\n| --- | --- |");
for (const [k, v] of rows) console.log(`| ${k} | ${v} |`);

if (problems.length > 0) {
  for (const p of problems) console.error(`FAILED: ${p}`);
  console.error(`kills:\n  ${killLog.join("\n  ")}`);
  console.error(`the process logs are in ${logDir}; the database ${db.name} is kept`);
  Deno.exit(1);
}
if (KEEP_LOGS) console.log(`\nprocess logs: ${logDir}`);
else await Deno.remove(logDir, { recursive: true });
console.log("\nOK: every batch run done once, one email each, at batch prices; no batch created twice.");
if (budgetMode && !CORRUPT_BUDGET) {
  console.log(
    "OK: no hold left; each budget's spend is its model_attempts rows and the provider's report; none passed.",
  );
}
if (CORRUPT_BUDGET) console.log("OK: the budget checks caught the corrupted budget (holds, spend, limit).");
