/**
 * `deno task chaos:door`: chat completions through the OpenAI-compatible door (issue 42), sent by the real
 * `openai` SDK with an `Idempotency-Key` each, while the API and the workers are SIGKILLed and restarted; then
 * every completion, run and model call counted.
 *
 *   deno task chaos:door [--runs N] [--duration S] [--seed S] [--drain-timeout S] [--keep-logs]
 *
 * It starts the API and two workers as `main.ts` subprocesses with the permission sets their tasks derive,
 * against a scratch Postgres database and an empty Redis database index (no relay: a chat run notifies nobody,
 * and the run checks that no outbox row was written). The model is a fake OpenAI-compatible server on loopback
 * (`OPENAI_MODEL=gpt-door`): 10% of its answers take 1 to 3 s, 5% are a `500` and 3% a `429 rate_limit_exceeded`
 * with `retry-after-ms` (the worker retries both); every answer names the call that made it (`Answer 17 for job
 * 4: ...`), so a run done twice, or an answer handed to the wrong key, shows. `OPENAI_COMPAT_WAIT_S=2`.
 *
 * N chat completions (default 200) are started over `--duration` seconds (default 20), one tenant, each with its
 * own key and a user message naming it (`job 4`), through one `OpenAI` client (`baseURL` the API's `/v1`,
 * `maxRetries: 4`: the SDK retries 408, 409, 429, 5xx and connection errors itself, with the key, which is a
 * per-call header). One in four is `stream: true`; one in three sends `Prefer: wait=1`, so a slow run answers `408`
 * (`x-should-retry: true`) or, streamed, an SSE `run_pending` error. Each key is asked again, with the same key and
 * body, until it gets a completion: after the SDK gave up (its retries spent on a dead API), after a stream that a
 * kill cut off, after a streamed `run_pending`. One key in five is then asked once more, streamed if it was not and
 * plain if it was: the answer must be a replay (`Idempotent-Replayed: true`) of the same completion.
 *
 * Meanwhile, every 1 to 3 s, the API or one of the workers (each half the time; the first kill a
 * worker, the second the API) is SIGKILLed and started again, until the kill period is over; then everything
 * drains. The API is killed while requests are in flight (waited for up to 2 s): awaiting their answer, or a
 * stream being read. Checks (any failure exits 1 and names what failed):
 *
 * - every key got a completion; all completions one key got (plain and streamed, first and repeated) have the
 *   same `id` and the same content; every answer about a key named the same run (`Oncely-Run-Id`), and its `id`
 *   is `chatcmpl-` and that run id without dashes; two keys never share a run; each repeat was a replay;
 * - each completion's content is an answer the fake model gave to a call about that key's own message;
 * - in Postgres, each key's run has exactly one `job_outcomes` row, `done`, and one `run_results` row whose
 *   output is the completion's content and whose input is that key's message; no outcome, result or model
 *   attempt row exists for a run no key asked for; Redis holds a status record for exactly the keys' runs: N runs;
 * - a run's model call answered more than once only when a worker was SIGKILLed between the two calls (a retry of
 *   the API's answer makes no call); no outbox row, no dead letter; no process exited on its own, and each
 *   stopped within 15 s of SIGTERM.
 */
import OpenAI from "openai";
import { Redis } from "ioredis";
import { sleep } from "../../src/async/timeout.ts";
import { parseConfig } from "../../src/config.ts";
import { KEY_PREFIX } from "../../src/runs/keys.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { defaultAnswer, errorBody, type ModelBehaviour, startFakeModel } from "../support/fake_model_server.ts";
import { freePort } from "../support/free_port.ts";
import { seededRandom } from "../support/random.ts";
import { createScratchDatabase, emptyRedisDatabase, releaseRedisDatabase } from "../support/scratch.ts";
import { apiHealthy, createSpawner, numberOption, type Proc, stopAll, taskArgsOf } from "./_processes.ts";

// ---------------------------------------------------------------- options
const args = Deno.args;
const option = (name: string, fallback: number) => numberOption(args, name, fallback);
const RUNS = Math.max(1, Math.floor(option("runs", 200)));
const DURATION_S = option("duration", 20);
const DRAIN_TIMEOUT_S = option("drain-timeout", 300);
const KEEP_LOGS = args.includes("--keep-logs");
const SEED = option("seed", Date.now() % 1_000_000);
const random = seededRandom(SEED);
/** The wait a request has without `Prefer: wait` (OPENAI_COMPAT_WAIT_S). */
const WAIT_S = 2;

const ADMIN_URL = Deno.env.get("CHAOS_DATABASE_URL") ?? "postgres://postgres@127.0.0.1:5432/postgres";
const logDir = await Deno.makeTempDir({ prefix: "oncely-chaos-door-" });
const wallStart = performance.now();
const elapsed = () => `${((performance.now() - wallStart) / 1000).toFixed(1)} s`;
const note = (line: string) => Deno.stderr.writeSync(new TextEncoder().encode(`[${elapsed()}] ${line}\n`));

// ---------------------------------------------------------------- the model
const MODEL = "gpt-door";
/** What names a key in its message, and so in every model call about it. */
const JOB_NAMED = /\bjob (\d+)\b/;
/** What an answer of the fake says: which call made it, and for which key's message. */
const ANSWER_NAMED = /^Answer (\d+) for job (\d+):/;

/** One call the fake model received. */
interface ModelCall {
  /** The job its last message named (NaN for none). */
  job: number;
  at: number;
  kind: "ok" | "slow" | "500" | "429";
}
const modelCalls: ModelCall[] = [];

const model = startFakeModel((n, prompt): ModelBehaviour => {
  const job = Number(JOB_NAMED.exec(prompt)?.[1]);
  const roll = random();
  const call: ModelCall = { job, at: performance.now(), kind: "ok" };
  modelCalls[n - 1] = call;
  if (roll < 0.05) {
    call.kind = "500";
    return { kind: "status", status: 500, body: errorBody("The server had an error.", "server_error") };
  }
  if (roll < 0.08) {
    call.kind = "429";
    const retry = 100 + Math.floor(random() * 300);
    return {
      kind: "status",
      status: 429,
      headers: { "retry-after-ms": String(retry) },
      body: errorBody(`Rate limit reached. Please try again in ${retry}ms.`, "requests", "rate_limit_exceeded"),
    };
  }
  const slow = roll < 0.18;
  if (slow) call.kind = "slow";
  const body = model.bodies[n - 1] as Parameters<typeof defaultAnswer>[0];
  return {
    kind: "ok",
    delayMs: slow ? 1_000 + Math.floor(random() * 2_000) : Math.floor(random() * 30),
    content: `Answer ${n} for job ${job}: ${defaultAnswer(body)}`,
    usage: "realistic",
  };
});

// ---------------------------------------------------------------- Redis, Postgres, the tenant
const db = await createScratchDatabase(ADMIN_URL, { prefix: "oncely_chaos_door" });
const redisUrl = await emptyRedisDatabase(Deno.env.get("CHAOS_REDIS_URL") ?? "redis://127.0.0.1:6379/0");
const redisAdmin = new Redis(redisUrl, { maxRetriesPerRequest: null });
redisAdmin.on("error", () => {});
const TENANT = "door";
const apiKey = await createApiKey(db.sql, TENANT);

// ---------------------------------------------------------------- processes
const apiPort = freePort();
const env: Record<string, string> = {
  DATABASE_URL: db.url,
  REDIS_URL: redisUrl,
  PORT: String(apiPort),
  OPENAI_API_KEY: "sk-chaos",
  OPENAI_BASE_URL: model.url,
  OPENAI_MODEL: MODEL,
  OPENAI_COMPAT_WAIT_S: String(WAIT_S),
  IDEMPOTENCY_LOCK_TTL_S: "3",
  // A delivery cut off by a kill is claimed again 3 s later (the heartbeat keeps a live one's claim fresh).
  CLAIM_IDLE_MS: "3000",
  WORKER_CONCURRENCY: "16",
  LLM_CALL_TIMEOUT_S: "10",
  LLM_BREAKER_COOLDOWN_S: "1",
  LOG_LEVEL: "info",
  NO_COLOR: "1",
};
const config = parseConfig(env);
const { spawn, killedByUs, selfExits } = createSpawner({ logDir, env, argsOf: (task) => taskArgsOf(task, config) });
const procs: Proc[] = [];
for (const [name, task] of [["api", "api"], ["worker-1", "worker"], ["worker-2", "worker"]] as const) {
  procs.push(await spawn(name, task));
}

// ---------------------------------------------------------------- kills
let apiKills = 0, workerKills = 0;
/** When each worker kill began (`performance.now()`). */
const workerKilledAt: number[] = [];
const killLog: string[] = [];
/**
 * Requests in flight at the API when it was killed, summed over its kills: requests awaiting their answer's
 * headers, and streams being read.
 */
let cutAtApiKills = 0;
let inFlight = 0, streamsOpen = 0;

/** SIGKILLs `victim` and starts it again; @returns once the replacement is up (or after 30 s). */
async function killAndRestart(victim: Proc): Promise<void> {
  if (victim.task === "api") {
    apiKills++;
    cutAtApiKills += inFlight + streamsOpen;
  } else {
    workerKills++;
    workerKilledAt.push(performance.now());
  }
  killLog.push(
    `${elapsed()} ${victim.name} (${inFlight} requests in flight, ${streamsOpen} streams open, ${settledKeys} keys ` +
      `settled)`,
  );
  killedByUs.add(victim.child);
  victim.child.kill("SIGKILL");
  await victim.child.status;
  await victim.logged; // its last lines before the replacement's first
  await sleep(random() * 300);
  const replacement = await spawn(victim.name, victim.task);
  procs[procs.indexOf(victim)] = replacement;
  const bound = new AbortController();
  await Promise.race([replacement.started, sleep(30_000, bound.signal).catch(() => {})]);
  bound.abort();
  if (victim.task === "api") await apiHealthy(apiPort, 30_000, logDir).catch(() => {});
}

/** Kills every 1 to 3 s until `until` (and at least one worker, then the API). */
async function killLoop(until: number): Promise<void> {
  const firstKills: Proc["task"][] = ["worker", "api"];
  while (performance.now() < until || firstKills.length > 0) {
    await sleep(1_000 + random() * 2_000);
    if (performance.now() >= until && firstKills.length === 0) break;
    const task = firstKills.shift() ?? (random() < 0.5 ? "api" : "worker");
    // The API is killed with requests in flight (waited for up to 2 s): most answers take a few milliseconds.
    for (const end = performance.now() + 2_000; task === "api" && inFlight + streamsOpen === 0;) {
      if (performance.now() > end) break;
      await sleep(5);
    }
    const candidates = procs.filter((p) => p.task === task);
    await killAndRestart(candidates[Math.floor(random() * candidates.length)]!);
  }
}

// ---------------------------------------------------------------- the clients
/** One key: what was asked, and every answer it got. */
interface Key {
  i: number;
  key: string;
  stream: boolean;
  waitOne: boolean;
  repeat: boolean;
  /** Every run id the API's answers about this key named (`Oncely-Run-Id`). */
  runIds: Set<string>;
  completions: Completion[];
  /** Why the key got no completion (a refusal that retrying cannot change, or the drain timeout). */
  failure?: string;
  /** Chunks of one stream that carried another id than the stream's first. */
  streamIdMismatch?: boolean;
}
interface Completion {
  id: string;
  content: string;
  streamed: boolean;
  replayed: boolean;
  runId: string | null;
  /** The second call, made once the key had its completion. */
  repeat: boolean;
}

const keys: Key[] = [];
const keyByName = new Map<string, Key>();
let settledKeys = 0;

// What the SDK's fetch saw: every request and answer (the SDK's own retries included).
let httpRequests = 0, sdkRetries = 0, connectionErrors = 0, replayedAnswers = 0;
const statuses = new Map<string, number>();
const bump = (map: Map<string, number>, key: string) => map.set(key, (map.get(key) ?? 0) + 1);
// Why a key was asked again by its own loop (after the SDK gave up or a stream broke).
let outerRetries = 0;
const outerReasons = new Map<string, number>();
let streamedPending = 0;

const recordingFetch = async (input: string | URL | Request, init?: RequestInit): Promise<Response> => {
  const headers = new Headers(init?.headers);
  const k = keyByName.get(headers.get("idempotency-key") ?? "");
  httpRequests++;
  if (Number(headers.get("x-stainless-retry-count") ?? 0) > 0) sdkRetries++;
  inFlight++;
  let res: Response;
  try {
    res = await fetch(input, init);
  } catch (error) {
    connectionErrors++;
    throw error;
  } finally {
    inFlight--;
  }
  bump(statuses, String(res.status));
  if (res.headers.get("idempotent-replayed") === "true") replayedAnswers++;
  const run = res.headers.get("oncely-run-id");
  if (k && run) k.runIds.add(run);
  return res;
};

const client = new OpenAI({
  apiKey,
  baseURL: `http://127.0.0.1:${apiPort}/v1`,
  maxRetries: 4,
  timeout: 60_000,
  fetch: recordingFetch,
});

const WORDS = "invoice login export crash refund upgrade latency password report invoice sync quota".split(" ");
/** Key i's message: distinct, naming the key. */
function message(i: number): string {
  const w = (s: number) => WORDS[(i * 7 + s * 3) % WORDS.length];
  return `Customer note ${SEED}-${i} about job ${i}. The ${w(0)} page fails after the ${w(1)} change. ` +
    `Since then every ${w(2)} attempt ends in an error. Please summarise what happened in job ${i}.`;
}
const request = (k: Key) => ({
  model: MODEL,
  messages: [{ role: "user" as const, content: message(k.i) }],
  max_completion_tokens: 200,
});

/** A stream that ended without its `finish_reason` chunk (the connection closed under it). */
class StreamCut extends Error {}

/** One SDK call for `k` (the SDK retrying inside it): its completion, or a throw. */
async function callOnce(k: Key, stream: boolean, repeat: boolean): Promise<Completion> {
  const headers: Record<string, string> = { "Idempotency-Key": k.key, ...(k.waitOne ? { Prefer: "wait=1" } : {}) };
  if (!stream) {
    const { data, response } = await client.chat.completions.create(request(k), { headers }).withResponse();
    return {
      id: data.id,
      content: data.choices[0]?.message.content ?? "",
      streamed: false,
      replayed: response.headers.get("idempotent-replayed") === "true",
      runId: response.headers.get("oncely-run-id"),
      repeat,
    };
  }
  const { data, response } = await client.chat.completions.create({
    ...request(k),
    stream: true,
    ...(k.i % 8 === 1 ? { stream_options: { include_usage: true } } : {}),
  }, { headers }).withResponse();
  let id: string | undefined, content = "", finished = false;
  streamsOpen++;
  try {
    for await (const chunk of data) {
      id ??= chunk.id;
      if (chunk.id !== id) k.streamIdMismatch = true;
      content += chunk.choices[0]?.delta.content ?? "";
      if (chunk.choices[0]?.finish_reason) finished = true;
    }
  } finally {
    streamsOpen--;
  }
  if (!finished || id === undefined) throw new StreamCut("the stream ended without its finish_reason");
  return {
    id,
    content,
    streamed: true,
    replayed: response.headers.get("idempotent-replayed") === "true",
    runId: response.headers.get("oncely-run-id"),
    repeat,
  };
}

/** Why a call failed, when asking again with the key is right; undefined for a refusal that is final. */
function retryable(error: unknown): string | undefined {
  if (error instanceof StreamCut) return "stream cut off";
  if (error instanceof OpenAI.APIConnectionError) return "SDK gave up: connection";
  if (error instanceof OpenAI.APIError) {
    if (error.status === undefined) {
      // An error event in a stream: only the run's pending is to be waited for again.
      if (error.code === "run_pending") {
        streamedPending++;
        return "streamed run_pending";
      }
      return undefined;
    }
    if (error.status === 408) return "SDK gave up: 408";
    if (error.status === 409 || error.status === 429 || error.status >= 500) return `SDK gave up: ${error.status}`;
    return undefined;
  }
  // A body cut off mid-read (the API killed under a stream), or its last SSE line torn.
  return `cut: ${error instanceof Error ? error.name : typeof error}`;
}

/** Asks for `k` until a completion (or a final refusal, or the deadline). */
async function ask(k: Key, stream: boolean, repeat: boolean, deadline: number): Promise<boolean> {
  for (let attempt = 1;; attempt++) {
    try {
      k.completions.push(await callOnce(k, stream, repeat));
      return true;
    } catch (error) {
      const reason = retryable(error);
      const text = error instanceof Error ? `${error.constructor.name}: ${error.message}` : String(error);
      if (reason === undefined) {
        k.failure = `refused${repeat ? " (repeat)" : ""}: ${text}`;
        return false;
      }
      if (performance.now() > deadline) {
        k.failure = `no completion by the deadline${repeat ? " (repeat)" : ""}; last: ${text}`;
        return false;
      }
      outerRetries++;
      bump(outerReasons, reason);
      await sleep(250 + random() * 750);
    }
  }
}

/** Key i, from its first call to its last. */
async function runKey(i: number, deadline: number): Promise<void> {
  const k: Key = {
    i,
    key: `door-chaos-${String(SEED).padStart(6, "0")}-${String(i).padStart(6, "0")}`,
    stream: i % 4 === 1,
    waitOne: i % 3 === 0,
    repeat: random() < 0.2,
    runIds: new Set(),
    completions: [],
  };
  keys.push(k);
  keyByName.set(k.key, k);
  try {
    if (await ask(k, k.stream, false, deadline) && k.repeat) await ask(k, !k.stream, true, deadline);
  } finally {
    settledKeys++;
  }
}

// ---------------------------------------------------------------- the run
/** Runs decided in Postgres of those the keys named. */
async function decided(): Promise<number> {
  const ids = [...new Set(keys.flatMap((k) => [...k.runIds]))];
  const [row] = await db.sql<{ n: number }[]>`
    SELECT count(*)::int AS n FROM job_outcomes WHERE job_id = ANY(${ids}::uuid[])`;
  return row!.n;
}

let failure: unknown;
let loadS = NaN, drainS = NaN;
try {
  await apiHealthy(apiPort, 60_000, logDir);
  await Promise.all(procs.map((p) => p.started));
  note(`${RUNS} chat completions over ${DURATION_S} s, seed ${SEED}; logs in ${logDir}`);
  const start = performance.now();
  const killsUntil = start + DURATION_S * 1000;
  const deadline = killsUntil + DRAIN_TIMEOUT_S * 1000;
  const killing = killLoop(killsUntil);
  const progress = setInterval(() => {
    decided().then((n) =>
      note(
        `keys started ${keys.length}/${RUNS}, settled ${settledKeys}; runs decided ${n}; model calls ` +
          `${modelCalls.length}; kills api ${apiKills} / workers ${workerKills}; requests ${httpRequests}`,
      ), () => {});
  }, 5_000);
  try {
    const spacingMs = (DURATION_S * 1000) / RUNS;
    const clients: Promise<void>[] = [];
    for (let i = 0; i < RUNS; i++) {
      const due = start + i * spacingMs;
      if (due > performance.now()) await sleep(due - performance.now());
      clients.push(runKey(i, deadline));
    }
    loadS = (performance.now() - start) / 1000;
    await killing;
    const killsOver = performance.now();
    await Promise.all(clients);
    drainS = (performance.now() - killsOver) / 1000;
    // Late effects (a stray second call, a second outcome) would show within a moment.
    await sleep(2_000);
  } finally {
    clearInterval(progress);
  }
} catch (error) {
  failure = error;
}

// ---------------------------------------------------------------- checks
const problems: string[] = [];
const check = (ok: boolean, problem: string) => ok || problems.push(problem);
if (failure) problems.push(`the run did not finish: ${failure instanceof Error ? failure.message : failure}`);

/** At most `n` of `items`, for a FAILED line. */
const few = <T>(items: readonly T[], show: (item: T) => string, n = 3) =>
  items.slice(0, n).map(show).join("; ") + (items.length > n ? `; ... (${items.length} in all)` : "");
/** Counts of `rows` by `key`. */
function countBy<T>(rows: readonly T[], key: (row: T) => string): Map<string, number> {
  const counts = new Map<string, number>();
  for (const r of rows) counts.set(key(r), (counts.get(key(r)) ?? 0) + 1);
  return counts;
}
const dashless = (runId: string) => runId.replaceAll("-", "");

keys.sort((a, b) => a.i - b.i);
check(keys.length === RUNS, `${RUNS - keys.length} of ${RUNS} keys never asked`);

// Every key a completion; one completion per key, however often and however it was asked.
const failed = keys.filter((k) => k.failure !== undefined || k.completions.length === 0);
check(
  failed.length === 0,
  `${failed.length} key(s) got no completion: ${few(failed, (k) => `job ${k.i}: ${k.failure}`)}`,
);
const idsDiffer = keys.filter((k) => new Set(k.completions.map((c) => c.id)).size > 1);
check(
  idsDiffer.length === 0,
  `${idsDiffer.length} key(s) got completions with different ids: ${
    few(idsDiffer, (k) => `job ${k.i}: ${k.completions.map((c) => c.id).join(" / ")}`)
  }`,
);
const contentsDiffer = keys.filter((k) => new Set(k.completions.map((c) => c.content)).size > 1);
check(
  contentsDiffer.length === 0,
  `${contentsDiffer.length} key(s) got completions with different content (plain / streamed): ${
    few(contentsDiffer, (k) => `job ${k.i}: ${k.completions.map((c) => JSON.stringify(c.content)).join(" / ")}`)
  }`,
);
const streamMixed = keys.filter((k) => k.streamIdMismatch);
check(streamMixed.length === 0, `${streamMixed.length} stream(s) whose chunks carried two ids`);
const runsDiffer = keys.filter((k) => k.runIds.size > 1);
check(
  runsDiffer.length === 0,
  `${runsDiffer.length} key(s) whose answers named more than one run: ${
    few(runsDiffer, (k) => `job ${k.i}: ${[...k.runIds].join(" / ")}`)
  }`,
);
/** Each key's run: the one its answers named. */
const runOf = new Map(keys.filter((k) => k.runIds.size === 1).map((k) => [k, [...k.runIds][0]!]));
const idNotRun = keys.filter((k) => k.completions.some((c) => c.id !== `chatcmpl-${dashless(runOf.get(k) ?? "?")}`));
check(
  idNotRun.length === 0,
  `${idNotRun.length} completion id(s) not chatcmpl- and the run named by Oncely-Run-Id: ${
    few(idNotRun, (k) => `job ${k.i}: ${k.completions.map((c) => c.id).join(" / ")} vs ${[...k.runIds].join(",")}`)
  }`,
);
const sharedRuns = [...countBy([...runOf.values()], (id) => id).entries()].filter(([, n]) => n > 1);
check(sharedRuns.length === 0, `${sharedRuns.length} run(s) named by two keys: ${few(sharedRuns, ([id]) => id)}`);
const repeats = keys.flatMap((k) => k.completions.filter((c) => c.repeat).map((c) => ({ k, c })));
const repeatsNotReplayed = repeats.filter(({ c }) => !c.replayed);
check(
  repeatsNotReplayed.length === 0,
  `${repeatsNotReplayed.length} repeat(s) of a completed key not answered as a replay: ${
    few(repeatsNotReplayed, ({ k }) => `job ${k.i}`)
  }`,
);

// Each completion an answer the model gave to a call about the key's own message.
const okCallsOf = new Map<number, number[]>();
modelCalls.forEach((call, n) => {
  if (call.kind === "ok" || call.kind === "slow") okCallsOf.set(call.job, [...okCallsOf.get(call.job) ?? [], n + 1]);
});
const notItsAnswer = keys.filter((k) =>
  k.completions.some((c) => {
    const m = ANSWER_NAMED.exec(c.content);
    return !m || Number(m[2]) !== k.i || !okCallsOf.get(k.i)?.includes(Number(m[1]));
  })
);
check(
  notItsAnswer.length === 0,
  `${notItsAnswer.length} completion(s) not an answer of the model to a call about the key's message: ${
    few(notItsAnswer, (k) => `job ${k.i}: ${JSON.stringify(k.completions[0]?.content.slice(0, 40))}`)
  }`,
);
const callsNamingNoKey = modelCalls.filter((c) => !(c.job >= 0 && c.job < RUNS)).length;
check(callsNamingNoKey === 0, `${callsNamingNoKey} model call(s) about no key's message`);
// A second answered call for one run only when a worker kill came between them: a replay of the API's answer,
// or the SDK's retry, makes none.
const answeredTwice = keys.filter((k) => (okCallsOf.get(k.i)?.length ?? 0) > 1);
const twiceWithoutKill = answeredTwice.filter((k) => {
  const times = okCallsOf.get(k.i)!.map((n) => modelCalls[n - 1]!.at).sort((a, b) => a - b);
  return times.some((t, j) => j > 0 && !workerKilledAt.some((w) => w >= times[j - 1]! && w < t));
});
check(
  twiceWithoutKill.length === 0,
  `${twiceWithoutKill.length} run(s) whose model call was answered again with no worker kill in between: ${
    few(twiceWithoutKill, (k) => `job ${k.i} (calls ${okCallsOf.get(k.i)!.join(", ")})`)
  }`,
);

// Postgres and Redis: one done outcome and one result per key's run, and no run beyond them.
const runIds = [...runOf.values()];
const runSet = new Set(runIds);
const outcomes = await db.sql<{ job_id: string; outcome: string }[]>`SELECT job_id::text, outcome FROM job_outcomes`;
const results = await db.sql<{ run_id: string; input: { messages?: { content?: string }[] }; output: unknown }[]>`
  SELECT run_id::text, input, output FROM run_results`;
const attempts = await db.sql<{ job_id: string; outcome: string }[]>`SELECT job_id::text, outcome FROM model_attempts`;
const [{ outbox } = { outbox: -1 }] = await db.sql<{ outbox: number }[]>`SELECT count(*)::int AS outbox FROM outbox`;
const outcomesOf = countBy(outcomes, (o) => o.job_id);
const doneOf = countBy(outcomes.filter((o) => o.outcome === "done"), (o) => o.job_id);
const resultsOf = countBy(results, (r) => r.run_id);
const resultOf = new Map(results.map((r) => [r.run_id, r]));
const notOneOutcome = runIds.filter((id) => outcomesOf.get(id) !== 1 || doneOf.get(id) !== 1);
check(
  notOneOutcome.length === 0,
  `${notOneOutcome.length} run(s) without exactly one job_outcomes row, done: ${
    few(notOneOutcome, (id) => `${id} (${outcomes.filter((o) => o.job_id === id).map((o) => o.outcome)})`)
  }`,
);
const notOneResult = runIds.filter((id) => resultsOf.get(id) !== 1);
check(
  notOneResult.length === 0,
  `${notOneResult.length} run(s) without exactly one run_results row: ${few(notOneResult, (id) => id)}`,
);
const resultNotAnswer = keys.filter((k) => {
  const r = resultOf.get(runOf.get(k) ?? "");
  if (!r) return false;
  return r.output !== k.completions[0]?.content || r.input.messages?.[0]?.content !== message(k.i);
});
check(
  resultNotAnswer.length === 0,
  `${resultNotAnswer.length} run_results row(s) whose output is not the completion or input not the key's message: ${
    few(resultNotAnswer, (k) => `job ${k.i}`)
  }`,
);
const strayOutcomes = outcomes.filter((o) => !runSet.has(o.job_id));
const strayResults = results.filter((r) => !runSet.has(r.run_id));
const strayAttempts = attempts.filter((a) => !runSet.has(a.job_id));
check(strayOutcomes.length === 0, `${strayOutcomes.length} job_outcomes row(s) for runs no key asked for`);
check(strayResults.length === 0, `${strayResults.length} run_results row(s) for runs no key asked for`);
check(strayAttempts.length === 0, `${strayAttempts.length} model_attempts row(s) for runs no key asked for`);
// Redis: a status record for each run intake accepted.
const records: string[] = [];
const recordPattern = `${KEY_PREFIX}:{t:*}:job:*`;
let cursor = "0";
do {
  const [next, found] = await redisAdmin.scan(cursor, "MATCH", recordPattern, "COUNT", 1000);
  cursor = next;
  records.push(...found);
} while (cursor !== "0");
const recordRuns = new Set(records.map((r) => r.slice(r.lastIndexOf(":") + 1)));
const strayRecords = [...recordRuns].filter((id) => !runSet.has(id));
const unrecorded = runIds.filter((id) => !recordRuns.has(id));
check(strayRecords.length === 0, `${strayRecords.length} run(s) in Redis that no key asked for`);
check(unrecorded.length === 0, `${unrecorded.length} key's run(s) without a Redis status record`);
const allRuns = new Set([...recordRuns, ...outcomes.map((o) => o.job_id), ...results.map((r) => r.run_id)]);
check(allRuns.size === RUNS, `${allRuns.size} runs exist for ${RUNS} keys`);
check(outbox === 0, `${outbox} outbox row(s): a chat run notified (and no relay is running)`);
const deadLetters = await redisAdmin.xlen(`${KEY_PREFIX}:{t:${TENANT}}:dead`).catch(() => -1);
check(deadLetters === 0, `${deadLetters} dead letter(s)`);

// ---------------------------------------------------------------- clean up
const stuck = await stopAll(procs, killedByUs);
check(selfExits.length === 0, `processes exited on their own: ${selfExits.join(", ")}`);
check(stuck.length === 0, `did not exit within 15 s of SIGTERM (then SIGKILLed): ${stuck.join(", ")}`);
await model.close();
await redisAdmin.quit().catch(() => redisAdmin.disconnect());
await releaseRedisDatabase(redisUrl).catch(() => {});
// A failed run keeps its database for a post-mortem (dropped by the next `DROP DATABASE`, by hand).
if (problems.length > 0) await db.sql.end({ timeout: 1 });
else await db.close();

// ---------------------------------------------------------------- report
const calls = countBy(modelCalls, (c) => c.kind);
const attemptRuns = new Set(attempts.map((a) => a.job_id));
const completions = keys.flatMap((k) => k.completions);
const status = (s: string) => statuses.get(s) ?? 0;
const rows: [string, string][] = [
  ["seed", String(SEED)],
  [
    "keys (chat completions asked for) / streamed / with Prefer: wait=1 / asked again once completed",
    `${keys.length} / ${keys.filter((k) => k.stream).length} / ${keys.filter((k) => k.waitOne).length} / ${
      keys.filter((k) => k.repeat).length
    }`,
  ],
  ["keys with a completion / runs (Postgres and Redis)", `${keys.length - failed.length} / ${allRuns.size}`],
  [
    "runs with other than one done outcome / one result; runs no key asked for",
    `${notOneOutcome.length} / ${notOneResult.length}; ${strayRecords.length + strayOutcomes.length}`,
  ],
  [
    "keys whose completions differ (id / content) / whose answers named two runs",
    `${idsDiffer.length} / ${contentsDiffer.length} / ${runsDiffer.length}`,
  ],
  [
    "completions received: plain / streamed (replays among them)",
    `${completions.filter((c) => !c.streamed).length} / ${completions.filter((c) => c.streamed).length} (${
      completions.filter((c) => c.replayed).length
    })`,
  ],
  [
    "model calls: answered / of them slow (1-3 s) / 500 / 429",
    `${modelCalls.length}: ${(calls.get("ok") ?? 0) + (calls.get("slow") ?? 0)} / ${calls.get("slow") ?? 0} / ${
      calls.get("500") ?? 0
    } / ${calls.get("429") ?? 0}`,
  ],
  [
    "runs whose call was answered twice (a worker kill between each time)",
    `${answeredTwice.length} (${answeredTwice.length - twiceWithoutKill.length})`,
  ],
  [
    "model_attempts rows / runs done without one (not a check: a worker killed before its attempt log's batch)",
    `${attempts.length} / ${runIds.filter((id) => !attemptRuns.has(id)).length}`,
  ],
  ["SIGKILLs: API / workers", `${apiKills} / ${workerKills}`],
  ["requests in flight at the API when it was killed (summed)", String(cutAtApiKills)],
  [
    "HTTP requests the SDK sent / of them its own retries / connection errors",
    `${httpRequests} / ${sdkRetries} / ${connectionErrors}`,
  ],
  [
    "answers: 200 / 408 / other",
    `${status("200")} / ${status("408")} / ${
      [...statuses.entries()].filter(([s]) => s !== "200" && s !== "408").map(([s, n]) => `${s} x${n}`).join(", ") ||
      "-"
    }`,
  ],
  ["streamed run_pending errors (a stream's 408)", String(streamedPending)],
  ["answers with Idempotent-Replayed: true", String(replayedAnswers)],
  [
    "asked again by the client's own loop (after the SDK gave up, or a stream broke)",
    `${outerRetries}${
      outerReasons.size > 0 ? ` (${[...outerReasons.entries()].map(([r, n]) => `${r} x${n}`).join(", ")})` : ""
    }`,
  ],
  ["load took / from the end of the kills to the last completion", `${loadS.toFixed(1)} s / ${drainS.toFixed(1)} s`],
  ["wall time", elapsed()],
];
console.log("\n| door chaos run | result |\n| --- | --- |");
for (const [k, v] of rows) console.log(`| ${k} | ${v} |`);

if (problems.length > 0) {
  for (const p of problems) console.error(`FAILED: ${p}`);
  console.error(`kills:\n  ${killLog.join("\n  ")}`);
  console.error(`the process logs are in ${logDir}; the database ${db.name} is kept`);
  Deno.exit(1);
}
if (KEEP_LOGS) console.log(`\nprocess logs: ${logDir}`);
else await Deno.remove(logDir, { recursive: true });
console.log("\nOK: nothing lost, nothing duplicated: every key one run, one completion, one result.");
