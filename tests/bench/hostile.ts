/**
 * `deno task bench --only=hostile`: issue 37's "Done when" figures, measured from outside against the real
 * processes (`deno task api` through its launcher, `main.ts worker`, a fake model in its own process), each
 * against a baseline taken in the same run:
 *
 * 1. A tenant's input schema with the most costly pattern the API accepts, 200 run POSTs of it at once (inputs of
 *    200 digits, of the longest string a validation Worker's estimate admits, and of 100 KB): how long each waits
 *    for its answer and what it is, the API process's CPU (every 100 ms from `/proc/<pid>/stat`) and RSS until
 *    5 s after the last answer, and another tenant's steady requests, against the same flood on a benign pattern
 *    and against that tenant's requests with no flood. Two patterns the API must refuse are PUT too.
 * 2. The same for output validation in the worker process: 200 runs whose answers (200 digits) are validated
 *    against the pattern, the worker's CPU and RSS, and another tenant's runs from accepted to decided; and (not
 *    in the smoke run) 20 runs whose answers are as long as a validation Worker's estimate admits, watched 20 s.
 * 3. Runs that each name another stored version of a task with the pattern (every version's schema is compiled
 *    once), 20 a second, against the same with a benign pattern and another tenant's requests meanwhile.
 * 4. Tenants PUT the largest definitions the limits allow until the quota refuses one, page through
 *    `GET /v1/tasks` and run each task once: the API's RSS before, at its peak and after, and the largest page.
 * 5. A PUT identical to the latest version against a new one (latency, the API's CPU per PUT), and 50 PUTs a
 *    second of new heavy definitions from one tenant for 10 s, against another tenant's steady reads; again with
 *    the rate lifted (not in the smoke run).
 *
 * Every light load runs in a process of its own (`steady_load.ts`), so the bursts the bench sends and the
 * processes under test do not delay its clock. Each part starts a deployment of its own (a scratch database, an
 * empty Redis database index, the processes). `BENCH_HOSTILE_PARTS=input,output,versions,definitions,puts` picks
 * parts.
 */
import { Redis } from "ioredis";
import type { Sql } from "postgres";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { measureDefinition } from "../../src/jobs/task_store.ts";
import { DEFINITION_LIMITS, TaskDefinition } from "../../src/tasks/definition.ts";
import { compileSchema } from "../../src/tasks/json_schema.ts";
import { costed, estimate } from "../../src/tasks/validation_cost.ts";
import { VALIDATION_LIMITS } from "../../src/tasks/validator.ts";
import { DEFINITION_CHECK } from "../../src/tasks/definition_checker.ts";
import { TASK_CACHE } from "../../src/tasks/task_cache.ts";
import { createScratchDatabase, emptyRedisDatabase, releaseRedisDatabase } from "../support/scratch.ts";
import { freePort } from "../support/free_port.ts";
import { heavyDefinition, wideSchema } from "../support/task_definitions.ts";
import { startApi } from "./api_server.ts";
import { startModelProcess, startWorkerProcess } from "./worker_process.ts";
import { fmt, median, quantile } from "./stats.ts";
import { epochMs, type SteadyLoadConfig, type SteadySample } from "./steady_load.ts";
import { RUN_BODY, TRIAGE_BODIES } from "./triage_task.ts";

/** One line of the bench's table, for this section and every other in `run.ts`. */
export interface HostileRow {
  benchmark: string;
  result: string;
  baseline?: string;
  ratio?: string;
  goal?: string;
  value: number;
  baselineValue?: number;
}

/** Where and how long to measure. */
export interface HostileOptions {
  adminUrl: string;
  redisUrl: string;
  smoke: boolean;
  /** Rounds of each flood (medians are reported). */
  runs: number;
  progress: (msg: string) => void;
}

/**
 * The most costly pattern per character we found that the API's PUT accepts (RE2 size 1,991 of the 2,000 allowed;
 * ten bounded repetitions, the most allowed; not anchored at the start, so a thread starts at every character and
 * the work goes on to the end of the text; a `\p{...}` class, which costs more per step than `\d`). Every string of
 * digits matches it: a validation that finishes says the input is valid. Measured in the bench process: 40-50 µs a
 * character at 200 digits, 70-85 µs at 6,000 (`\d{0,198}` repeated, anchored at the start: 4 µs at 10,000, since
 * no thread lives past 1,980 characters).
 */
export const HOSTILE_PATTERN = "[\\p{L}\\p{N}]{0,198}".repeat(10) + "$";

/** The issue's patterns, which the shape check must refuse (a repetition in a repetition; overlapping `\d*`). */
export const REFUSED_PATTERNS: Record<string, string> = {
  nested: "^(\\d*)*\\d*\\d*\\d*\\d*\\d*\\d*\\d*\\d*\\d*x$",
  adjacent: "^\\d*\\d*\\d*\\d*\\d*\\d*\\d*\\d*\\d*\\d*x$",
};

/** The same flood on a pattern every engine runs in a step a character. */
const BENIGN_PATTERN = "^\\d+$";

const LIGHT_RATE = 50;
/** The issue's bound on what a flood may leave in RSS, 50 MB, in MiB. */
const FIFTY_MB = 50e6 / 2 ** 20;
const DEFAULT_PUT_RATE = "TASK_PUTS_PER_MINUTE=60, TASK_PUT_BURST=20 (defaults)";

// --- Processes -----------------------------------------------------------------------------------------------

/** A deployment of its own: a scratch database, an empty Redis database, the real API (and worker). */
interface Deployment {
  base: string;
  apiPid: number;
  workerPid?: number;
  sql: Sql;
  key(tenant: string): Promise<string>;
  stop(): Promise<void>;
}

async function deploy(
  o: HostileOptions,
  env: Record<string, string>,
  worker?: { modelUrl: string },
): Promise<Deployment> {
  const db = await createScratchDatabase(o.adminUrl, { prefix: "oncely_bench" });
  const redisUrl = await emptyRedisDatabase(o.redisUrl);
  const redis = new Redis(redisUrl, { maxRetriesPerRequest: 1 });
  // A key at once: another bench looking for an empty database index now skips this one.
  await redis.set("oncely_bench_hostile", "in use");
  const port = freePort();
  const common = {
    DATABASE_URL: db.url,
    REDIS_URL: redisUrl,
    LOG_LEVEL: "info",
    ...(worker ? { OPENAI_API_KEY: "sk-bench", OPENAI_BASE_URL: worker.modelUrl, LLM_RPM: "", LLM_TPM: "" } : {}),
    ...env,
  };
  const cleanup = async () => {
    await redis.quit().catch(() => redis.disconnect());
    await releaseRedisDatabase(redisUrl).catch(() => {});
    await db.close();
  };
  let api: Awaited<ReturnType<typeof startApi>> | undefined;
  let workerProcess: Awaited<ReturnType<typeof startWorkerProcess>> | undefined;
  try {
    api = await startApi({ ...common, PORT: String(port) });
    if (worker) workerProcess = await startWorkerProcess(common);
  } catch (error) {
    await api?.stop();
    await cleanup();
    throw error;
  }
  return {
    base: `http://127.0.0.1:${port}`,
    apiPid: api.pids[0]!,
    workerPid: workerProcess?.pid,
    sql: db.sql,
    key: (tenant) => createApiKey(db.sql, tenant),
    async stop() {
      await workerProcess?.stop();
      await api!.stop();
      await cleanup();
    },
  };
}

/** The answer to one request. */
interface Answer {
  sent: number;
  answered: number;
  status: number;
  // deno-lint-ignore no-explicit-any
  body: any;
  retryAfter: string | null;
  bytes: number;
}

async function call(
  base: string,
  key: string,
  method: string,
  path: string,
  body?: unknown,
  headers: Record<string, string> = {},
): Promise<Answer> {
  const sent = epochMs();
  try {
    const res = await fetch(`${base}${path}`, {
      method,
      headers: { authorization: `Bearer ${key}`, "content-type": "application/json", ...headers },
      body: body === undefined ? undefined : typeof body === "string" ? body : JSON.stringify(body),
      signal: AbortSignal.timeout(60_000),
    });
    const text = await res.text();
    const answered = epochMs();
    let parsed: unknown = text;
    try {
      parsed = JSON.parse(text);
    } catch { /* not JSON */ }
    return {
      sent,
      answered,
      status: res.status,
      body: parsed,
      retryAfter: res.headers.get("retry-after"),
      bytes: new TextEncoder().encode(text).length,
    };
  } catch (error) {
    return { sent, answered: epochMs(), status: 0, body: String(error), retryAfter: null, bytes: 0 };
  }
}

const newKey = () => ({ "idempotency-key": `hostile-${crypto.randomUUID()}` });

/** PUTs a task and insists on the answer. */
async function putTask(d: Deployment, key: string, name: string, body: unknown, expect = 201): Promise<Answer> {
  const answer = await call(d.base, key, "PUT", `/v1/tasks/${name}`, body);
  if (answer.status !== expect) {
    throw new Error(`PUT /v1/tasks/${name} answered ${answer.status}: ${JSON.stringify(answer.body).slice(0, 300)}`);
  }
  return answer;
}

/** The steady load of `steady_load.ts`, its answers collected as they come. */
async function startSteadyLoad(config: SteadyLoadConfig) {
  const child = new Deno.Command(Deno.execPath(), {
    args: ["run", "--allow-net=127.0.0.1", new URL("./steady_load.ts", import.meta.url).pathname],
    stdin: "piped",
    stdout: "piped",
    stderr: "inherit",
  }).spawn();
  const writer = child.stdin.getWriter();
  await writer.write(new TextEncoder().encode(JSON.stringify(config)));
  await writer.close();
  const samples: SteadySample[] = [];
  let stopping: Promise<SteadySample[]> | undefined;
  const lines = child.stdout.pipeThrough(new TextDecoderStream()).getReader();
  const ready = Promise.withResolvers<void>();
  const reading = (async () => {
    let buffered = "";
    for (;;) {
      const { value, done } = await lines.read();
      if (done) break;
      buffered += value;
      let nl;
      while ((nl = buffered.indexOf("\n")) >= 0) {
        const line = buffered.slice(0, nl);
        buffered = buffered.slice(nl + 1);
        if (line === "ready") ready.resolve();
        else if (line.startsWith("{")) samples.push(JSON.parse(line));
      }
    }
    ready.reject(new Error("the steady load stopped before it started"));
  })();
  await ready.promise;
  return {
    samples,
    stop(): Promise<SteadySample[]> {
      return stopping ??= (async () => {
        child.kill("SIGTERM");
        await child.status;
        await reading;
        return samples;
      })();
    },
  };
}

// --- /proc ---------------------------------------------------------------------------------------------------

const TICK_MS = 10; // Linux USER_HZ: /proc/<pid>/stat counts CPU time in 1/100 s

/**
 * A process's CPU time and resident memory at one moment, its child processes' (its validation and definition
 * check children: `src/tasks/pool_channels.ts`) included: CPU of every thread, those ended too, and of every child,
 * those ended and reaped too.
 */
interface ProcSample {
  at: number;
  cpuMs: number;
  /** The process's and its live children's. */
  rssMiB: number;
  /** The process's alone. */
  ownRssMiB: number;
  /** Its threads: the main one, V8's and Deno's helpers, and one for each Web Worker alive. */
  threads: number;
  /** Its child processes alive. */
  children: number;
}

/** CPU ms from a `/proc/<pid>/stat` or `/proc/<pid>/task/<tid>/stat` line: its own, and its reaped children's. */
function statCpuMs(stat: string, { reaped = false } = {}): number {
  const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
  const own = Number(fields[11]) + Number(fields[12]);
  return (reaped ? own + Number(fields[13]) + Number(fields[14]) : own) * TICK_MS;
}

async function readProc(pid: number): Promise<Omit<ProcSample, "at">> {
  // Deno treats /proc as privileged; `cat` (the bench may run programs) reads it for us, the children's too.
  const out = await new Deno.Command("sh", {
    args: [
      "-c",
      `cat /proc/${pid}/stat /proc/${pid}/status; for c in $(pgrep -P ${pid}); do ` +
      `echo @@; cat /proc/$c/stat /proc/$c/status 2>/dev/null; done`,
    ],
    stdout: "piped",
    stderr: "null",
  }).output();
  const [own, ...children] = new TextDecoder().decode(out.stdout).split("@@\n");
  const rssOf = (text: string) => Number(/VmRSS:\s+(\d+) kB/.exec(text)?.[1] ?? 0) / 1024;
  const firstLine = (text: string) => text.slice(0, text.indexOf("\n"));
  const live = children.filter((text) => text.includes("VmRSS"));
  const ownRssMiB = rssOf(own!);
  return {
    cpuMs: statCpuMs(firstLine(own!), { reaped: true }) +
      live.reduce((sum, text) => sum + statCpuMs(firstLine(text)), 0),
    rssMiB: ownRssMiB + live.reduce((sum, text) => sum + rssOf(text), 0),
    ownRssMiB,
    threads: Number(/Threads:\s+(\d+)/.exec(own!)?.[1] ?? NaN),
    children: live.length,
  };
}

/** CPU ms of the process's main thread alone (the one that serves requests), from its own stat line. */
async function mainThreadCpuMs(pid: number): Promise<number> {
  const out = await new Deno.Command("cat", { args: [`/proc/${pid}/task/${pid}/stat`], stdout: "piped" }).output();
  return statCpuMs(new TextDecoder().decode(out.stdout));
}

/** Samples a process every `everyMs` until stopped. */
function startSampler(pid: number, everyMs = 100) {
  const samples: ProcSample[] = [];
  let stopped = false;
  const loop = (async () => {
    for (let next = performance.now(); !stopped; next += everyMs) {
      const at = epochMs();
      samples.push({ at, ...await readProc(pid) });
      const wait = next + everyMs - performance.now();
      if (wait > 0) await new Promise((r) => setTimeout(r, wait));
    }
  })();
  return {
    samples,
    async stop() {
      stopped = true;
      await loop;
      return samples;
    },
  };
}

/** The last sample taken at or before `t` (the first one when none was). */
function sampleAt(samples: ProcSample[], t: number): ProcSample {
  let found = samples[0]!;
  for (const s of samples) {
    if (s.at <= t) found = s;
    else break;
  }
  return found;
}

/** CPU % of one core between two samples. */
const cpuPct = (a: ProcSample, b: ProcSample) => b.at > a.at ? ((b.cpuMs - a.cpuMs) / (b.at - a.at)) * 100 : NaN;

/** The average CPU % between two moments. */
function cpuBetween(samples: ProcSample[], from: number, to: number): number {
  return cpuPct(sampleAt(samples, from), sampleAt(samples, to));
}

/** The highest CPU % of one sampling step between two moments. */
function peakCpu(samples: ProcSample[], from: number, to: number): number {
  let peak = 0;
  for (let i = 1; i < samples.length; i++) {
    if (samples[i]!.at >= from && samples[i - 1]!.at <= to) peak = Math.max(peak, cpuPct(samples[i - 1]!, samples[i]!));
  }
  return peak;
}

/**
 * How long after `since` the process's CPU went back under `limit` % for good: the start of the first window of
 * `windowMs` after which every such window up to `until` averages under it (CPU time comes in 10 ms ticks, so a
 * single 100 ms step reads 0%, 10%, 20%...). Undefined when the last window is still over.
 */
function settledAfter(samples: ProcSample[], since: number, until: number, limit: number, windowMs: number) {
  const list = samples.filter((s) => s.at >= since - 50 && s.at <= until);
  let settled: number | undefined;
  for (let i = list.length - 1; i >= 0; i--) {
    const end = list.find((s) => s.at - list[i]!.at >= windowMs);
    if (!end) continue;
    if (cpuPct(list[i]!, end) >= limit) break;
    settled = Math.max(0, list[i]!.at - since);
  }
  return settled;
}

/** The highest RSS between two moments. */
function peakRss(samples: ProcSample[], from: number, to: number): number {
  return Math.max(...samples.filter((s) => s.at >= from && s.at <= to).map((s) => s.rssMiB));
}

// --- Figures -------------------------------------------------------------------------------------------------

const ms = (n: number) => `${fmt(n, n < 10 ? 1 : 0)} ms`;
const mib = (n: number) => `${fmt(n, 0)} MiB`;
const met = (ok: boolean) => (ok ? "(met)" : "(NOT met)");
const signedMiB = (n: number) => `${n >= 0 ? "+" : ""}${fmt(n, 0)} MiB`;

function statusCounts(answers: { status: number }[]): string {
  const counts = new Map<number, number>();
  for (const a of answers) counts.set(a.status, (counts.get(a.status) ?? 0) + 1);
  return [...counts].sort((a, b) => a[0] - b[0]).map(([s, n]) => `${s === 0 ? "no answer" : s}: ${n}`).join(", ");
}

/** Why the 422s were refused, in a word each. */
function refusalKinds(answers: Answer[]): string {
  const kinds = new Map<string, number>();
  for (const a of answers.filter((a) => a.status === 422)) {
    const detail = String(a.body?.errors?.[0]?.message ?? a.body?.detail ?? "");
    const kind = /estimated at more than/.test(detail)
      ? "too costly to validate"
      : /took longer than/.test(detail)
      ? "validation timed out"
      : /does not match|must match/.test(detail) || a.body?.title === "The input does not match the task's input schema"
      ? "schema violation"
      : detail.slice(0, 60);
    kinds.set(kind, (kinds.get(kind) ?? 0) + 1);
  }
  return [...kinds].map(([k, n]) => `${n} ${k}`).join(", ");
}

/** p50, p99 and max of latencies, with how many. */
function latencies(values: number[]) {
  return { p50: quantile(values, 0.5), p99: quantile(values, 0.99), max: Math.max(...values), n: values.length };
}
const latencyText = (l: ReturnType<typeof latencies>) =>
  `p99 ${ms(l.p99)} (p50 ${ms(l.p50)}, max ${ms(l.max)}, n=${l.n})`;

/** The steady load's latencies of requests sent between two moments, answered with one of `ok`. */
function steadyBetween(samples: SteadySample[], from: number, to: number) {
  const within = samples.filter((s) => s.at >= from && s.at <= to);
  return { ...latencies(within.map((s) => s.ms)), wrong: within.filter((s) => s.status < 200 || s.status >= 300) };
}

// --- 1. Input validation at intake ----------------------------------------------------------------------------

/** A task whose input's one string must match `pattern`. */
function inputTask(pattern: string) {
  return {
    prompt: "Check the code.",
    input_schema: {
      type: "object",
      properties: { code: { type: "string", pattern } },
      required: ["code"],
      additionalProperties: false,
    },
    max_output_tokens: 50,
  };
}

/** The longest string of digits a validation Worker would validate against `schema` (the estimate's bound). */
function longestAdmitted(schema: Record<string, unknown>, property: string, wrap = (v: unknown) => v): number {
  const copy = structuredClone(schema);
  const entry = costed(copy, compileSchema(copy, { stored: true }));
  const fits = (n: number) =>
    estimate(entry, wrap({ [property]: "7".repeat(n) }), VALIDATION_LIMITS.workerUnits) <=
      VALIDATION_LIMITS.workerUnits;
  let lo = 1, hi = 1_000_000;
  while (lo < hi) {
    const mid = Math.ceil((lo + hi) / 2);
    if (fits(mid)) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

/** Digits, `n` of them. */
const digits = (n: number) => Array.from({ length: n }, (_, i) => String((i * 7) % 10)).join("");

/** What a process did after a burst: how soon its CPU went back down, and its RSS. */
interface Aftermath {
  /** ms after the burst's end until the CPU stayed within 5 points of the light load's own level; Infinity: not seen. */
  settled: number;
  /** The same against 5% of a core (absolute), which the light load alone may already pass. */
  settledAbsolute: number;
  peakCpu: number;
  /** The process's and its children's. */
  rssBefore: number;
  rssPeak: number;
  rssAfter: number;
  /** The process's alone. */
  ownRssDelta: number;
  /** Its children alive at the end. */
  children: number;
}

/**
 * The process around a burst from `start` to `end` (its last answer, or its last run decided), observed until
 * `afterMs` after `end`; `baseCpu`: its CPU % under the light load alone, measured before.
 */
function aftermath(
  samples: ProcSample[],
  { start, end, afterMs, windowMs, baseCpu }: {
    start: number;
    end: number;
    afterMs: number;
    windowMs: number;
    baseCpu: number;
  },
): Aftermath {
  const settle = (limit: number) => settledAfter(samples, end, end + afterMs + windowMs, limit, windowMs) ?? Infinity;
  return {
    settled: settle(baseCpu + 5),
    settledAbsolute: settle(5),
    peakCpu: peakCpu(samples, start, end + afterMs),
    rssBefore: sampleAt(samples, start).rssMiB,
    rssPeak: peakRss(samples, start, end + afterMs),
    rssAfter: sampleAt(samples, end + afterMs).rssMiB,
    ownRssDelta: sampleAt(samples, end + afterMs).ownRssMiB - sampleAt(samples, start).ownRssMiB,
    children: sampleAt(samples, end + afterMs).children,
  };
}

const settleText = (ms: number, afterMs: number) =>
  Number.isFinite(ms) ? `${fmt(ms / 1000, 1)} s` : `not within ${afterMs / 1000} s`;

/**
 * Rounds of aftermaths in words (the median round's figures; each round's CPU and RSS), and whether the median
 * round's CPU settled within `afterMs` and its RSS came back within 50 MB.
 */
function aftermathSummary(rounds: Aftermath[], afterMs: number, baseCpu: number, what: string) {
  const mid = (f: (x: Aftermath) => number) => median(rounds.map(f));
  const deltas = rounds.map((x) => x.rssAfter - x.rssBefore);
  const rssDelta = median(deltas);
  const m = rounds.find((x) => x.rssAfter - x.rssBefore === rssDelta)!;
  const roundsText = rounds.length > 1
    ? `; rounds: ${rounds.map((x) => settleText(x.settled, afterMs)).join(", ")}`
    : "";
  const text =
    `CPU back within 5 points of the light load's ${fmt(baseCpu, 1)}% ${
      settleText(mid((x) => x.settled), afterMs)
    } after ${what}${roundsText} (under 5% absolute: ${settleText(mid((x) => x.settledAbsolute), afterMs)}; peak ${
      fmt(mid((x) => x.peakCpu))
    }% of a core); RSS ${mib(m.rssBefore)} before, ${mib(m.rssPeak)} peak, ${mib(m.rssAfter)} ${
      afterMs / 1000
    } s after (${signedMiB(rssDelta)}${rounds.length > 1 ? `; rounds: ${deltas.map(signedMiB).join(", ")}` : ""}; ` +
    `the process alone ${signedMiB(m.ownRssDelta)}, ${m.children} children alive), its validation children included`;
  return {
    text,
    rssDelta,
    settled: mid((x) => x.settled),
    // The median round for both: on this shared machine one round's light load can stay over its level for seconds.
    ok: mid((x) => x.settled) <= afterMs && rssDelta <= FIFTY_MB,
  };
}

/** One flood: what each POST was answered and when, and the API process around it. */
interface FloodRound extends Aftermath {
  answers: Answer[];
  start: number;
  lastSent: number;
  lastAnswer: number;
  maxMs: number;
}

async function inputFloods(o: HostileOptions): Promise<HostileRow[]> {
  const rows: HostileRow[] = [];
  const posts = o.smoke ? 20 : 200;
  const afterMs = o.smoke ? 500 : 5_000;
  const windowMs = o.smoke ? 250 : 1_000;
  const d = await deploy(o, {});
  let load: Awaited<ReturnType<typeof startSteadyLoad>> | undefined;
  let sampler: ReturnType<typeof startSampler> | undefined;
  try {
    const mallory = await d.key("mallory"), alice = await d.key("alice");
    // The issue's patterns, refused at PUT with the reason and where.
    const refusals: string[] = [];
    for (const [name, pattern] of Object.entries(REFUSED_PATTERNS)) {
      const answer = await call(d.base, mallory, "PUT", `/v1/tasks/refused-${name}`, inputTask(pattern));
      const error = answer.body?.errors?.[0];
      const message = String(error?.message ?? answer.body?.detail);
      const reason = /on some inputs \((.*)\): no nested/.exec(message)?.[1] ?? message.slice(0, 120);
      refusals.push(`\`${pattern}\`: ${answer.status} on ${error?.pointer} (${reason})`);
      if (answer.status !== 422) throw new Error(`a hostile pattern was answered ${answer.status}: ${pattern}`);
    }
    const accepted = await putTask(d, mallory, "hostile", inputTask(HOSTILE_PATTERN));
    await putTask(d, mallory, "benign", inputTask(BENIGN_PATTERN));
    rows.push({
      benchmark: "Hostile patterns at PUT /v1/tasks/{name} (the shape check, real API)",
      result: refusals.join("; "),
      baseline:
        `accepted: \`[\\p{L}\\p{N}]{0,198}\` ten times, then \`$\` (RE2 size 1,991 of 2,000): ${accepted.status}`,
      goal: "the issue's patterns refused (met)",
      value: refusals.length,
    });
    const edge = longestAdmitted(inputTask(HOSTILE_PATTERN).input_schema, "code");
    const kinds = [
      { label: "200 digits", code: digits(200) },
      { label: `${fmt(edge)} digits (the longest a validation Worker's estimate admits)`, code: digits(edge) },
      { label: "100 KB of digits", code: digits(100_000) },
    ];
    // Tenant alice: one run to read, then a steady load of reads of it and POSTs of new ordinary runs.
    await putTask(d, alice, "triage", TRIAGE_BODIES.text);
    const first = await call(d.base, alice, "POST", "/v1/tasks/triage/runs", RUN_BODY, newKey());
    if (first.status !== 202) throw new Error(`alice's run answered ${first.status}`);
    const auth = { authorization: `Bearer ${alice}`, "content-type": "application/json" };
    sampler = startSampler(d.apiPid);
    await sleep(o.smoke ? 200 : 2_000);
    const idleCpu = cpuBetween(sampler.samples, sampler.samples[0]!.at, epochMs());
    load = await startSteadyLoad({
      base: d.base,
      rate: LIGHT_RATE,
      requests: [
        { method: "GET", path: `/v1/runs/${first.body.run_id}`, headers: auth },
        { method: "POST", path: "/v1/tasks/triage/runs", headers: auth, body: RUN_BODY, idempotencyKey: true },
      ],
    });
    await sleep(o.smoke ? 200 : 2_000); // the light load's paths compiled before its baseline
    const baseStart = epochMs();
    o.progress(`hostile: input floods: ${o.smoke ? 0.5 : 5} s of tenant alice's light load alone`);
    await sleep(o.smoke ? 500 : 5_000);
    const baseEnd = epochMs();
    const baseCpu = cpuBetween(sampler.samples, baseStart, baseEnd);
    o.progress(`hostile: API CPU idle ${fmt(idleCpu, 1)}%, under alice's light load ${fmt(baseCpu, 1)}%`);

    const floodRound = async (task: string, code: string): Promise<FloodRound> => {
      const body = JSON.stringify({ input: { code } });
      const start = epochMs();
      const answers = await Promise.all(
        Array.from({ length: posts }, () => call(d.base, mallory, "POST", `/v1/tasks/${task}/runs`, body, newKey())),
      );
      const lastAnswer = Math.max(...answers.map((a) => a.answered));
      await sleep(Math.max(0, lastAnswer + afterMs + windowMs + 200 - epochMs()));
      return {
        answers,
        start,
        lastSent: Math.max(...answers.map((a) => a.sent)),
        lastAnswer,
        maxMs: Math.max(...answers.map((a) => a.answered - a.sent)),
        ...aftermath(sampler!.samples, { start, end: lastAnswer, afterMs, windowMs, baseCpu }),
      };
    };
    // The other tenant's requests sent from a flood's start to `afterMs` after its last answer.
    const other = (x: FloodRound, samples = load!.samples) =>
      samples.filter((s) => s.at >= x.start && s.at <= x.lastAnswer + afterMs);

    const results: { hostile: FloodRound[]; benign: FloodRound[] }[] = kinds.map(() => ({ hostile: [], benign: [] }));
    for (let r = 0; r < o.runs; r++) {
      for (const [k, kind] of kinds.entries()) {
        const order = (r + k) % 2 === 0 ? (["benign", "hostile"] as const) : (["hostile", "benign"] as const);
        for (const which of order) {
          const round = await floodRound(which, kind.code);
          results[k]![which].push(round);
          o.progress(
            `hostile: ${posts} POSTs, ${which} pattern, ${kind.label} (round ${r + 1}): max ${ms(round.maxMs)}; ` +
              `${statusCounts(round.answers)} (${refusalKinds(round.answers)}); CPU back after ${
                settleText(round.settled, afterMs)
              } (peak ${fmt(round.peakCpu)}%); RSS ${mib(round.rssBefore)} -> ${mib(round.rssPeak)} -> ${
                mib(round.rssAfter)
              }; alice p99 meanwhile ${ms(latencies(other(round).map((s) => s.ms)).p99)}`,
          );
        }
      }
    }
    const all = await load.stop();
    load = undefined;
    await sampler.stop();
    sampler = undefined;
    const baseOther = steadyBetween(all, baseStart, baseEnd);

    for (const [k, kind] of kinds.entries()) {
      const { hostile, benign } = results[k]!;
      const mid = (list: FloodRound[]) => list.find((x) => x.maxMs === median(list.map((y) => y.maxMs)))!;
      const h = mid(hostile), b = mid(benign);
      const worst = Math.max(...hostile.map((x) => x.maxMs));
      const retryAfter = hostile.flatMap((x) => x.answers).filter((a) => a.status === 503).every((a) => a.retryAfter);
      rows.push({
        benchmark: `Hostile input pattern: ${posts} run POSTs at once (each its own Idempotency-Key) of one tenant's ` +
          `task, input ${kind.label}, real API`,
        result: `every answer within ${ms(h.maxMs)} (worst round ${ms(worst)}); ${statusCounts(h.answers)}${
          h.answers.some((a) => a.status === 422) ? ` (${refusalKinds(h.answers)})` : ""
        }${
          h.answers.some((a) => a.status === 503)
            ? `, every 503 ${retryAfter ? "with" : "NOT all with"} Retry-After`
            : ""
        }; all sent within ${ms(h.lastSent - h.start)}`,
        baseline: `same flood, benign pattern \`^\\d+$\`: within ${ms(b.maxMs)}; ${statusCounts(b.answers)}`,
        ratio: `${fmt(h.maxMs / b.maxMs, 1)}x`,
        goal: `every answer <= 1 s ${met(worst <= 1_000 && hostile.every((x) => x.answers.every((a) => a.status)))}`,
        value: h.maxMs,
        baselineValue: b.maxMs,
      });
      const hs = aftermathSummary(hostile, afterMs, baseCpu, "the last answer");
      const bs = aftermathSummary(benign, afterMs, baseCpu, "the last answer");
      rows.push({
        benchmark: `API process after that flood (CPU every 100 ms from /proc/<pid>/stat, over 1 s windows; RSS), ` +
          `until ${afterMs / 1000} s after its last answer; tenant alice's light load (${LIGHT_RATE}/s) throughout`,
        result: hs.text,
        baseline: `benign flood: ${bs.text}; API CPU idle ${fmt(idleCpu, 1)}%, light load alone ${fmt(baseCpu, 1)}%`,
        ratio: signedMiB(hs.rssDelta),
        goal: `CPU back within 5 s, RSS back within 50 MB ${met(hs.ok)}`,
        value: hs.settled,
        baselineValue: bs.settled,
      });
      const during = latencies(hostile.flatMap((x) => other(x, all).map((s) => s.ms)));
      const wrong = hostile.flatMap((x) => other(x, all)).filter((s) => s.status < 200 || s.status >= 300).length;
      const benignOther = latencies(benign.flatMap((x) => other(x, all).map((s) => s.ms)));
      rows.push({
        benchmark: `Tenant alice's requests (GET /v1/runs/{id} and POST of an ordinary run, ${LIGHT_RATE}/s, open ` +
          `loop) from that flood's start to ${afterMs / 1000} s after its last answer`,
        result: `${latencyText(during)}${wrong ? `; ${wrong} answered other than 2xx` : ""}`,
        baseline: `no flood, same run: ${latencyText(baseOther)}; benign flood: p99 ${ms(benignOther.p99)}`,
        ratio: `${fmt(during.p99 / baseOther.p99, 1)}x`,
        goal: `p99 < 50 ms (the PUT flood's goal) ${met(during.p99 < 50 && wrong === 0)}`,
        value: during.p99,
        baselineValue: baseOther.p99,
      });
    }
  } finally {
    await load?.stop();
    await sampler?.stop();
    await d.stop();
  }
  return rows;
}

// --- 2. Output validation in the worker -----------------------------------------------------------------------

const HOSTILE_MARKER = "[[hostile-output]]";
const LONG_MARKER = "[[hostile-output-long]]";

/** A task of mallory's whose answer's one string must match the hostile pattern; `marker` picks the fake's answer. */
function outputTask(marker: string, maxOutputTokens: number) {
  return {
    prompt: `${marker} Answer for {{input.n}}.`,
    input_schema: { type: "object", properties: { n: { type: "integer" } }, required: ["n"] },
    output_schema: {
      type: "object",
      properties: { code: { type: "string", pattern: HOSTILE_PATTERN } },
      required: ["code"],
      additionalProperties: false,
    },
    max_output_tokens: maxOutputTokens,
  };
}

async function outputFloods(o: HostileOptions): Promise<HostileRow[]> {
  const runs = o.smoke ? 20 : 200;
  const afterMs = o.smoke ? 500 : 5_000;
  const windowMs = o.smoke ? 250 : 1_000;
  const aliceRate = 10;
  const edge = longestAdmitted(outputTask(LONG_MARKER, 4096).output_schema, "code");
  const answers = await Deno.makeTempFile({ prefix: "oncely-bench-answers-", suffix: ".json" });
  await Deno.writeTextFile(
    answers,
    JSON.stringify([
      { marker: HOSTILE_MARKER, content: JSON.stringify({ code: digits(200) }) },
      { marker: LONG_MARKER, content: JSON.stringify({ code: digits(edge) }) },
    ]),
  );
  const model = await startModelProcess(0, { answersFile: answers });
  let d: Deployment | undefined;
  let load: Awaited<ReturnType<typeof startSteadyLoad>> | undefined;
  let sampler: ReturnType<typeof startSampler> | undefined;
  try {
    d = await deploy(o, {}, { modelUrl: model.url });
    const mallory = await d.key("mallory"), alice = await d.key("alice");
    await putTask(d, mallory, "hostile-out", outputTask(HOSTILE_MARKER, 1024));
    await putTask(d, mallory, "hostile-long", outputTask(LONG_MARKER, 4096));
    await putTask(d, alice, "triage", TRIAGE_BODIES.json);
    sampler = startSampler(d.workerPid!);
    await sleep(o.smoke ? 200 : 2_000);
    const idleCpu = cpuBetween(sampler.samples, sampler.samples[0]!.at, epochMs());
    load = await startSteadyLoad({
      base: d.base,
      rate: aliceRate,
      capture: "run_id",
      requests: [{
        method: "POST",
        path: "/v1/tasks/triage/runs",
        headers: { authorization: `Bearer ${alice}`, "content-type": "application/json" },
        body: RUN_BODY,
        idempotencyKey: true,
      }],
    });
    await sleep(o.smoke ? 200 : 2_000);
    o.progress(`hostile: output floods: ${o.smoke ? 0.5 : 5} s of tenant alice's runs alone (${aliceRate}/s)`);
    const baseStart = epochMs();
    await sleep(o.smoke ? 500 : 5_000);
    const baseEnd = epochMs();
    const baseCpu = cpuBetween(sampler.samples, baseStart, baseEnd);
    o.progress(`hostile: worker CPU idle ${fmt(idleCpu, 1)}%, under alice's runs ${fmt(baseCpu, 1)}%`);
    const decidedAt = async (ids: string[]) => {
      const found = await d!.sql<{ id: string; at: number; outcome: string }[]>`
        SELECT job_id::text AS id, extract(epoch FROM decided_at)::float8 * 1000 AS at, outcome
        FROM job_outcomes WHERE job_id = ANY(${ids}::uuid[])`;
      return new Map(found.map((r) => [r.id, r]));
    };
    const postRuns = async (task: string, n: number, from: number) => {
      const posted = await Promise.all(
        Array.from(
          { length: n },
          (_, i) => call(d!.base, mallory, "POST", `/v1/tasks/${task}/runs`, { input: { n: from + i } }, newKey()),
        ),
      );
      return { statuses: statusCounts(posted), ids: posted.filter((p) => p.status === 202).map((p) => p.body.run_id) };
    };
    const rounds: (Aftermath & { start: number; lastDecided: number; outcomes: string; statuses: string })[] = [];
    for (let r = 0; r < o.runs; r++) {
      const start = epochMs();
      const { statuses, ids } = await postRuns("hostile-out", runs, r * 1_000);
      let decided = await decidedAt(ids);
      for (const end = epochMs() + 180_000; decided.size < ids.length; decided = await decidedAt(ids)) {
        if (epochMs() > end) throw new Error(`hostile output: ${decided.size}/${ids.length} runs decided in 180 s`);
        await sleep(50);
      }
      const lastDecided = Math.max(...[...decided.values()].map((x) => x.at));
      await sleep(Math.max(0, lastDecided + afterMs + windowMs + 200 - epochMs()));
      const outcomes = new Map<string, number>();
      for (const x of decided.values()) outcomes.set(x.outcome, (outcomes.get(x.outcome) ?? 0) + 1);
      const round = {
        start,
        lastDecided,
        outcomes: [...outcomes].map(([k, n]) => `${k}: ${n}`).join(", "),
        statuses,
        ...aftermath(sampler.samples, { start, end: lastDecided, afterMs, windowMs, baseCpu }),
      };
      rounds.push(round);
      o.progress(
        `hostile: ${runs} runs with hostile output (round ${r + 1}): POSTs ${round.statuses}; decided ${
          ms(lastDecided - start)
        } after the first POST (${round.outcomes}); worker CPU back after ${settleText(round.settled, afterMs)} (peak ${
          fmt(round.peakCpu)
        }%); RSS ${mib(round.rssBefore)} -> ${mib(round.rssPeak)} -> ${mib(round.rssAfter)}`,
      );
    }
    // Answers as long as a validation Worker's estimate admits: each takes longer than the deadline to validate.
    let long: { start: number; end: number; ids: string[]; decided: number; attempts: number; cpu: number } | undefined;
    if (!o.smoke) {
      const n = 20, watchMs = 20_000;
      o.progress(`hostile: ${n} runs answered ${fmt(edge)} digits, watched for ${watchMs / 1000} s`);
      const start = epochMs();
      const { ids } = await postRuns("hostile-long", n, 100_000);
      await sleep(watchMs);
      const end = epochMs();
      const [{ attempts }] = await d.sql<[{ attempts: number }]>`
        SELECT count(*)::int AS attempts FROM model_attempts WHERE job_id = ANY(${ids}::uuid[])`;
      long = {
        start,
        end,
        ids,
        decided: (await decidedAt(ids)).size,
        attempts,
        cpu: cpuBetween(sampler.samples, start + 5_000, end),
      };
      o.progress(
        `hostile: ${long.decided}/${n} long-answer runs decided in ${watchMs / 1000} s, ${attempts} model calls, ` +
          `worker CPU ${fmt(long.cpu)}% over the last ${(watchMs - 5_000) / 1000} s`,
      );
    }
    const all = await load.stop();
    load = undefined;
    await sampler.stop();
    sampler = undefined;
    // Alice's runs from accepted (its 202 answered) to decided (job_outcomes.decided_at).
    const aliceRuns = all.filter((s) => s.id);
    let decided = await decidedAt(aliceRuns.map((s) => s.id!));
    for (const end = epochMs() + 60_000; decided.size < aliceRuns.length && epochMs() < end;) {
      await sleep(100);
      decided = await decidedAt(aliceRuns.map((s) => s.id!));
    }
    const latency = (windows: [number, number][]) =>
      latencies(
        aliceRuns.filter((s) => decided.has(s.id!) && windows.some(([from, to]) => s.at >= from && s.at <= to))
          .map((s) => Math.max(0, decided.get(s.id!)!.at - (s.at + s.ms))),
      );
    const base = latency([[baseStart, baseEnd]]);
    const during = latency(rounds.map((x) => [x.start, x.lastDecided]));
    const undecided = aliceRuns.length - decided.size;
    const summary = aftermathSummary(rounds, afterMs, baseCpu, "the last run was decided");
    const mid = rounds.find((x) => x.lastDecided - x.start === median(rounds.map((y) => y.lastDecided - y.start)))!;
    const rows: HostileRow[] = [
      {
        benchmark: `Hostile output pattern: ${runs} runs at once of one tenant's task whose output schema has the ` +
          `pattern, the fake model answering 200 digits (valid), real worker process (WORKER_CONCURRENCY=32)`,
        result:
          `all decided ${fmt((mid.lastDecided - mid.start) / 1000, 1)} s after the first POST (${mid.outcomes}); ` +
          summary.text,
        baseline: `worker CPU idle ${fmt(idleCpu, 1)}%, under tenant alice's runs alone (${aliceRate}/s) ${
          fmt(baseCpu, 1)
        }%`,
        ratio: signedMiB(summary.rssDelta),
        goal: `CPU back within 5 s, RSS back within 50 MB ${met(summary.ok)}`,
        value: summary.settled,
      },
      {
        benchmark:
          `Tenant alice's runs (${aliceRate}/s, an output schema of 3 properties), accepted (202) to decided ` +
          `(job_outcomes), while those ${runs} hostile runs were in the worker`,
        result: `${latencyText(during)}${undecided ? `; ${undecided} not decided in 60 s` : ""}`,
        baseline: `no hostile runs, same run: ${latencyText(base)}`,
        ratio: `${fmt(during.p99 / base.p99, 1)}x`,
        value: during.p99,
        baselineValue: base.p99,
      },
    ];
    if (long) {
      const meanwhile = latency([[long.start, long.end]]);
      rows.push({
        benchmark: `Hostile output at the estimate's edge: ${long.ids.length} runs whose answers are ${
          fmt(edge)
        } digits (the longest a validation Worker's estimate admits), watched for ${
          fmt((long.end - long.start) / 1000)
        } s`,
        result: `${long.decided}/${long.ids.length} decided; ${long.attempts} model calls; worker CPU ${
          fmt(long.cpu)
        }% of a core after the first 5 s; tenant alice's runs meanwhile ${latencyText(meanwhile)}`,
        baseline: `200-digit answers: ${runs} decided in ${fmt((mid.lastDecided - mid.start) / 1000, 1)} s`,
        goal: `decided, worker CPU back down ${met(long.decided === long.ids.length)}`,
        value: long.decided,
      });
    }
    return rows;
  } finally {
    await load?.stop();
    await sampler?.stop();
    await d?.stop();
    await model.stop();
    await Deno.remove(answers).catch(() => {});
  }
}

// --- 3. Definitions and the API's memory ----------------------------------------------------------------------

/** The largest definition the limits allow: `heavyDefinition` with a system message up to 256 KiB in all. */
function largestDefinition(seed: string, systemChars: number): Record<string, unknown> {
  return { ...heavyDefinition(seed), system: "s".repeat(systemChars) };
}

function largestSystemChars(seed: string): number {
  const bytes = (n: number) => measureDefinition(TaskDefinition.parse(largestDefinition(seed, n))).bytes;
  let lo = 0, hi = 100_000;
  while (lo < hi) {
    const mid = Math.ceil((lo + hi) / 2);
    if (bytes(mid) <= DEFINITION_LIMITS.maxBytes) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

/** An input every field of `wideSchema()` is given: what a run of a `heavyDefinition` task needs. */
function wideInput(): Record<string, unknown> {
  const schema = wideSchema() as { properties: Record<string, unknown> };
  return Object.fromEntries(Object.keys(schema.properties).map((name) => [name, { a: "x", b: 1 }]));
}

/** One tenant's hoard: its largest definitions PUT until its quota's 409, its list read, each task run once. */
async function hoard(o: HostileOptions, d: Deployment, tenant: string, systemChars: number) {
  const key = await d.key(tenant);
  const seed = (i: number) => `t${String(i).padStart(4, "0")}`;
  const start = epochMs();
  const puts: Answer[] = [];
  let stored = 0, full = false, next = 0;
  const putter = async () => {
    while (!full && next < 1_000) {
      const i = next++;
      const answer = await call(
        d.base,
        key,
        "PUT",
        `/v1/tasks/big-${seed(i)}`,
        largestDefinition(seed(i), systemChars),
      );
      puts.push(answer);
      if (answer.status === 201) stored++;
      else if (answer.status === 409) full = true;
      else if (answer.status === 503) await sleep(1_000);
      else throw new Error(`PUT of a large definition answered ${answer.status}: ${JSON.stringify(answer.body)}`);
    }
  };
  await Promise.all([putter(), putter()]);
  const putEnd = epochMs();
  const afterPuts = await readProc(d.apiPid);
  // The list, a page at a time, and the largest page there is.
  const pages: number[] = [];
  for (let path: string | null = "/v1/tasks"; path !== null;) {
    const page = await call(d.base, key, "GET", path);
    if (page.status !== 200) throw new Error(`GET ${path} answered ${page.status}`);
    pages.push(page.bytes);
    path = page.body.next;
  }
  const whole = await call(d.base, key, "GET", "/v1/tasks?limit=1000");
  const oneDefinition = await call(d.base, key, "GET", `/v1/tasks/big-${seed(0)}`);
  // Each task run once: its version read into the task cache, its input schema compiled and the input validated.
  const input = JSON.stringify({ input: wideInput() });
  const runs: Answer[] = [];
  let nextRun = 0, busy = 0;
  const runner = async () => {
    while (nextRun < stored) {
      const i = nextRun++;
      for (let tries = 0;; tries++) {
        const answer = await call(d.base, key, "POST", `/v1/tasks/big-${seed(i)}/runs`, input, newKey());
        if (answer.status === 503 && tries < 20) {
          busy++;
          await sleep(Number(answer.retryAfter ?? 1) * 1000);
          continue;
        }
        runs.push(answer);
        break;
      }
    }
  };
  await Promise.all(Array.from({ length: 4 }, runner));
  const afterRuns = await readProc(d.apiPid);
  o.progress(
    `hostile: tenant ${tenant}: ${stored} definitions stored; PUTs ${statusCounts(puts)} in ${
      fmt((putEnd - start) / 1000, 1)
    } s; runs ${statusCounts(runs)} (${busy} 503s retried) in ${fmt((epochMs() - putEnd) / 1000, 1)} s; RSS after ` +
      `the PUTs ${mib(afterPuts.rssMiB)}, after the runs ${mib(afterRuns.rssMiB)}`,
  );
  if (runs.some((a) => a.status !== 202)) {
    throw new Error(`runs of the large definitions answered ${statusCounts(runs)}`);
  }
  return {
    stored,
    puts,
    runs,
    afterPuts,
    afterRuns,
    largestPage: Math.max(whole.bytes, ...pages),
    listed: whole.body.tasks.length as number,
    pages,
    oneDefinition: oneDefinition.bytes,
  };
}

async function definitionMemory(o: HostileOptions): Promise<HostileRow[]> {
  const quota = o.smoke ? 1 << 20 : undefined;
  const env: Record<string, string> = { TASK_PUTS_PER_MINUTE: "60000", TASK_PUT_BURST: "10000" };
  if (quota) env.TASK_TENANT_MAX_BYTES = String(quota);
  const d = await deploy(o, env);
  let sampler: ReturnType<typeof startSampler> | undefined;
  try {
    const systemChars = largestSystemChars("t0000");
    const each = measureDefinition(TaskDefinition.parse(largestDefinition("t0000", systemChars))).bytes;
    sampler = startSampler(d.apiPid);
    await sleep(500);
    const start = epochMs();
    const before = sampleAt(sampler.samples, start);
    // A second tenant doing the same shows whether the API's memory grows with what is stored, or stops.
    const tenants = o.smoke ? ["hoarder"] : ["hoarder", "hoarder2"];
    o.progress(`hostile: definitions of ${fmt(each)} bytes PUT until the quota refuses one, tenants ${tenants}`);
    const hoards = [];
    for (const tenant of tenants) hoards.push(await hoard(o, d, tenant, systemChars));
    // Long enough for the definition-check child, stopped after 5 s idle, to stop (the API keeps its validation
    // children, each recycled once it has compiled its share).
    const idleS = o.smoke ? 1 : DEFINITION_CHECK.idleMs / 1000 + 10;
    await sleep(idleS * 1000);
    const samples = await sampler.stop();
    sampler = undefined;
    const peak = peakRss(samples, start, epochMs());
    const peakOwn = Math.max(...samples.filter((s) => s.at >= start).map((s) => s.ownRssMiB));
    const after = samples.at(-1)!;
    const phases = hoards.map((h, i) =>
      `tenant ${i + 1}: after its PUTs ${mib(h.afterPuts.ownRssMiB)}, after its runs ${mib(h.afterRuns.ownRssMiB)}`
    ).join("; ");
    const first = hoards[0]!;
    const storedMB = (first.stored * each) / 1e6;
    // The bounds the API process holds definitions to: its task cache, and the schemas compiled in its serving
    // thread; everything else is compiled in its children, each under its heap cap and ended once it has compiled
    // its share or is idle.
    const cacheMiB = TASK_CACHE.maxBytes / 2 ** 20;
    const compiledMiB = VALIDATION_LIMITS.cacheBytes / 2 ** 20;
    // And what the runtime keeps of the peak (V8's heap, the allocator's arenas): measured +65 and +70 MiB.
    const bound = cacheMiB + compiledMiB + 64;
    const grew = after.ownRssMiB - before.ownRssMiB;
    const quotaText = quota
      ? `TASK_TENANT_MAX_BYTES=${fmt(quota)} (the smoke run's)`
      : "TASK_TENANT_MAX_BYTES default 64 MiB";
    return [
      {
        benchmark:
          `Task definitions and the API's RSS: ${
            tenants.length === 1 ? "a tenant" : "two tenants, one after " +
              "the other,"
          } PUT definitions of ${fmt(each)} bytes (the 256 KiB limit) until the quota's 409 (${first.stored} ` +
          `each; ${quotaText}; TASK_PUTS_PER_MINUTE=60000, TASK_PUT_BURST=10000 for the bench), page through ` +
          `GET /v1/tasks and run each task once; then ${idleS} s idle`,
        result: `API process RSS ${mib(before.ownRssMiB)} before, ${mib(peakOwn)} peak, ${
          mib(after.ownRssMiB)
        } after ${idleS} s idle (${signedMiB(grew)}); with its validation children ${mib(before.rssMiB)} before, ${
          mib(peak)
        } peak, ${mib(after.rssMiB)} after (${after.children} children alive); ${phases}`,
        baseline: `definitions stored: ${fmt(storedMB, 1)} MB a tenant; PUTs ${statusCounts(first.puts)}; runs ${
          statusCounts(first.runs)
        }`,
        ratio: `${signedMiB(grew)} for ${fmt(storedMB * tenants.length, 0)} MB stored`,
        goal: `API process settled <= +${bound} MiB (the task cache's ${cacheMiB} MiB + its thread's compiled ` +
          `schemas' ${compiledMiB} MiB + 64 MiB the runtime keeps of its peak), only the kept validation children left ${
            met(grew <= bound && (o.smoke || after.children <= VALIDATION_LIMITS.workers))
          }`,
        value: grew,
        baselineValue: storedMB,
      },
      {
        benchmark: `The largest GET /v1/tasks body for that tenant (${first.stored} tasks of ${fmt(each)} bytes)`,
        result: `${fmt(first.largestPage)} bytes (limit=1000, ${first.listed} tasks); default page ${
          fmt(Math.max(...first.pages))
        } bytes (${first.pages.length} pages)`,
        baseline: `the definitions themselves: ${fmt(first.stored * each)} bytes (GET of one: ${
          fmt(first.oneDefinition)
        })`,
        ratio: `${fmt((first.largestPage / (first.stored * each)) * 100, 2)}%`,
        goal: `no definition in a list ${met(first.largestPage < each)}`,
        value: first.largestPage,
        baselineValue: first.stored * each,
      },
    ];
  } finally {
    await sampler?.stop();
    await d.stop();
  }
}

// --- 5. Runs naming many versions (a compile each) -----------------------------------------------------------

/**
 * Runs that each name another stored version of a task whose input schema has the hostile pattern: every
 * version's schema is compiled once per process (the validators' cache is per version, 500 at most), in the
 * API's thread. The versions are written to Postgres directly, as a tenant's PUTs would have stored them over
 * minutes at the default rate; against the same with a benign pattern, in the same run.
 */
async function versionChurn(o: HostileOptions): Promise<HostileRow[]> {
  const rate = 20, seconds = o.smoke ? 1 : 15, versions = rate * seconds + 10;
  const d = await deploy(o, {});
  let load: Awaited<ReturnType<typeof startSteadyLoad>> | undefined;
  try {
    const mallory = await d.key("mallory"), alice = await d.key("alice");
    for (const [name, pattern] of [["churn-benign", BENIGN_PATTERN], ["churn", HOSTILE_PATTERN]]) {
      const definition = (v: number) => ({ ...inputTask(pattern!), prompt: `Check the code (${v}).` });
      for (let v = 1; v <= versions; v++) {
        await d.sql`INSERT INTO tasks (tenant, name, version, definition)
          VALUES ('mallory', ${name!}, ${v}, ${d.sql.json(definition(v) as never)})`;
      }
    }
    await putTask(d, alice, "triage", TRIAGE_BODIES.text);
    const first = await call(d.base, alice, "POST", "/v1/tasks/triage/runs", RUN_BODY, newKey());
    const auth = { authorization: `Bearer ${alice}`, "content-type": "application/json" };
    load = await startSteadyLoad({
      base: d.base,
      rate: LIGHT_RATE,
      requests: [
        { method: "GET", path: `/v1/runs/${first.body.run_id}`, headers: auth },
        { method: "POST", path: "/v1/tasks/triage/runs", headers: auth, body: RUN_BODY, idempotencyKey: true },
      ],
    });
    await sleep(o.smoke ? 200 : 2_000);
    const baseStart = epochMs();
    await sleep(o.smoke ? 500 : 5_000);
    const baseEnd = epochMs();
    const churn = async (task: string) => {
      o.progress(`hostile: ${rate} run POSTs/s for ${seconds} s, each naming another version of ${task}`);
      const main0 = await mainThreadCpuMs(d.apiPid);
      const start = epochMs();
      const flood = await startSteadyLoad({
        base: d.base,
        rate,
        requests: [{
          method: "POST",
          path: `/v1/tasks/${task}/runs`,
          headers: { authorization: `Bearer ${mallory}`, "content-type": "application/json" },
          body: JSON.stringify({ input: { code: digits(200) }, version: "SEQ" }).replace('"SEQ"', "SEQ"),
          seq: "SEQ",
          seqFrom: 1,
          idempotencyKey: true,
        }],
      });
      await sleep(seconds * 1000);
      const answers = await flood.stop();
      const end = Math.max(...answers.map((s) => s.at + s.ms));
      const mainCpu = ((await mainThreadCpuMs(d.apiPid)) - main0) / (epochMs() - start) * 100;
      await sleep(o.smoke ? 200 : 2_000);
      return { start, end, answers, mainCpu };
    };
    const benign = await churn("churn-benign");
    const hostile = await churn("churn");
    const all = await load.stop();
    load = undefined;
    const base = steadyBetween(all, baseStart, baseEnd);
    const during = (x: { start: number; end: number }) => steadyBetween(all, x.start, x.end);
    const h = during(hostile), b = during(benign);
    o.progress(
      `hostile: version churn: hostile ${statusCounts(hostile.answers)}, main thread ${fmt(hostile.mainCpu)}%, alice ${
        latencyText(h)
      }; benign ${statusCounts(benign.answers)}, main thread ${fmt(benign.mainCpu)}%, alice ${latencyText(b)}`,
    );
    return [{
      benchmark: `Hostile input pattern over many versions: ${rate} run POSTs/s for ${seconds} s from one tenant, ` +
        `each naming another of ${versions} stored versions of its task (input 200 digits); tenant alice's requests ` +
        `(GET /v1/runs/{id} and POST of an ordinary run, ${LIGHT_RATE}/s) meanwhile`,
      result: `alice ${latencyText(h)}${h.wrong.length ? `; ${h.wrong.length} answered other than 2xx` : ""}; the ` +
        `POSTs: ${statusCounts(hostile.answers)}, p99 ${ms(latencies(hostile.answers.map((s) => s.ms)).p99)}; API ` +
        `main thread CPU ${fmt(hostile.mainCpu)}%`,
      baseline: `benign pattern \`^\\d+$\`, same run: alice ${latencyText(b)}; the POSTs ${
        statusCounts(benign.answers)
      }; main thread ${fmt(benign.mainCpu)}%; no POSTs: alice ${latencyText(base)}`,
      ratio: `${fmt(h.p99 / b.p99, 1)}x`,
      goal: `p99 < 50 ms (the PUT flood's goal) ${met(h.p99 < 50 && h.wrong.length === 0)}`,
      value: h.p99,
      baselineValue: b.p99,
    }];
  } finally {
    await load?.stop();
    await d.stop();
  }
}

// --- 4. PUTs: identical against new, and a flood --------------------------------------------------------------

/** `n` sequential PUTs: their latencies and the API process's CPU per PUT (all threads, and the main one). */
async function putBatch(d: Deployment, key: string, bodies: unknown[], expect: number) {
  const cpu0 = (await readProc(d.apiPid)).cpuMs, main0 = await mainThreadCpuMs(d.apiPid);
  const times: number[] = [];
  for (const body of bodies) {
    const answer = await putTask(d, key, "heavy", body, expect);
    times.push(answer.answered - answer.sent);
  }
  // The Worker that checked the last one reports before the answer; its thread's CPU is counted by then.
  const cpu1 = (await readProc(d.apiPid)).cpuMs, main1 = await mainThreadCpuMs(d.apiPid);
  return { ...latencies(times), cpuMs: (cpu1 - cpu0) / bodies.length, mainMs: (main1 - main0) / bodies.length };
}

async function putFlood(
  o: HostileOptions,
  d: Deployment,
): Promise<{ other: ReturnType<typeof steadyBetween>; base: ReturnType<typeof steadyBetween>; flood: SteadySample[] }> {
  const floodKey = await d.key("flood"), otherKey = await d.key("other");
  await putTask(d, otherKey, "small", TRIAGE_BODIES.text);
  const auth = { authorization: `Bearer ${otherKey}`, "content-type": "application/json" };
  const load = await startSteadyLoad({
    base: d.base,
    rate: LIGHT_RATE,
    requests: [
      { method: "GET", path: "/v1/tasks/small", headers: auth },
      { method: "GET", path: "/v1/tasks", headers: auth },
    ],
  });
  let flood: Awaited<ReturnType<typeof startSteadyLoad>> | undefined;
  try {
    const baseStart = epochMs();
    await sleep(o.smoke ? 500 : 5_000);
    const floodStart = epochMs();
    flood = await startSteadyLoad({
      base: d.base,
      rate: 50,
      requests: [{
        method: "PUT",
        path: "/v1/tasks/heavy",
        headers: { authorization: `Bearer ${floodKey}`, "content-type": "application/json" },
        body: JSON.stringify(heavyDefinition("flood-SEQ")),
        seq: "SEQ",
      }],
    });
    await sleep(o.smoke ? 1_000 : 10_000);
    const floodSamples = await flood.stop();
    flood = undefined;
    const floodEnd = Math.max(...floodSamples.map((s) => s.at + s.ms));
    await sleep(500);
    const samples = await load.stop();
    return {
      other: steadyBetween(samples, floodStart, floodEnd),
      base: steadyBetween(samples, baseStart, floodStart),
      flood: floodSamples,
    };
  } finally {
    await flood?.stop();
    await load.stop();
  }
}

async function putCosts(o: HostileOptions): Promise<HostileRow[]> {
  const rows: HostileRow[] = [];
  const d = await deploy(o, {});
  try {
    // Identical: one version, then the same body again; new: a new version each time (within the burst of 20).
    const same = await d.key("same"), fresh = await d.key("fresh");
    await putTask(d, same, "heavy", heavyDefinition("same"));
    await putTask(d, fresh, "heavy", heavyDefinition("fresh-warm"));
    const nSame = o.smoke ? 10 : 100, nNew = o.smoke ? 3 : 15;
    o.progress(`hostile: ${nSame} identical PUTs of a heavy definition, then ${nNew} new versions`);
    const identical = await putBatch(d, same, Array.from({ length: nSame }, () => heavyDefinition("same")), 200);
    const created = await putBatch(
      d,
      fresh,
      Array.from({ length: nNew }, (_, i) => heavyDefinition(`fresh-${i}`)),
      201,
    );
    const cpuRatio = identical.cpuMs / created.cpuMs;
    rows.push({
      benchmark: "PUT /v1/tasks/{name} identical to the latest version (a 190 KB definition with two 64 KiB " +
        "schemas), sequential, real API",
      result: `p50 ${ms(identical.p50)} (max ${ms(identical.max)}); API CPU ${ms(identical.cpuMs)}/PUT (main ` +
        `thread ${ms(identical.mainMs)}), n=${identical.n}`,
      baseline: `a new version each time: p50 ${ms(created.p50)} (max ${ms(created.max)}); API CPU ${
        ms(created.cpuMs)
      }/PUT (main thread ${ms(created.mainMs)}), n=${created.n}`,
      ratio: `${fmt(cpuRatio, 2)}x CPU, ${fmt(identical.p50 / created.p50, 2)}x p50`,
      goal: `identical compiles nothing: CPU < 1/4 of a new one's ${met(cpuRatio < 0.25)}`,
      value: identical.cpuMs,
      baselineValue: created.cpuMs,
    });
    o.progress(`hostile: ${o.smoke ? 1 : 10} s of 50 PUT/s of new heavy versions (${DEFAULT_PUT_RATE})`);
    const flood = await putFlood(o, d);
    rows.push(floodRow(o, flood, DEFAULT_PUT_RATE, true));
  } finally {
    await d.stop();
  }
  if (!o.smoke) {
    // The same with every PUT compiled: the rate and the quota lifted for the bench.
    const lifted = await deploy(o, {
      TASK_PUTS_PER_MINUTE: "60000",
      TASK_PUT_BURST: "10000",
      TASK_TENANT_MAX_BYTES: String(2 ** 30),
    });
    try {
      o.progress("hostile: the PUT flood again with the rate lifted (every PUT compiled)");
      const flood = await putFlood(o, lifted);
      rows.push(
        floodRow(o, flood, "TASK_PUTS_PER_MINUTE=60000, TASK_PUT_BURST=10000, TASK_TENANT_MAX_BYTES=1 GiB", false),
      );
    } finally {
      await lifted.stop();
    }
  }
  return rows;
}

function floodRow(
  o: HostileOptions,
  { other, base, flood }: Awaited<ReturnType<typeof putFlood>>,
  rate: string,
  judged: boolean,
): HostileRow {
  const floodLatency = latencies(flood.map((s) => s.ms));
  o.progress(
    `hostile: PUT flood (${rate}): ${statusCounts(flood)}; other tenant ${latencyText(other)}, alone ${
      latencyText(base)
    }`,
  );
  const wrong = other.wrong.length;
  return {
    benchmark: `PUT flood: 50 PUT/s of new versions of a 190 KB definition (two 64 KiB schemas) from one tenant ` +
      `for ${o.smoke ? 1 : 10} s (${rate}); another tenant's reads (GET /v1/tasks/{name}, GET /v1/tasks, ` +
      `${LIGHT_RATE}/s) meanwhile`,
    result: `${latencyText(other)}${wrong ? `; ${wrong} answered other than 2xx` : ""}; the flood's PUTs: ${
      statusCounts(flood)
    }, p99 ${ms(floodLatency.p99)}`,
    baseline: `no flood, same run: ${latencyText(base)}`,
    ratio: `${fmt(other.p99 / base.p99, 1)}x`,
    goal: judged ? `p99 < 50 ms ${met(other.p99 < 50 && wrong === 0)}` : "(the rate is what meets 50 ms)",
    value: other.p99,
    baselineValue: base.p99,
  };
}

// --- The section ----------------------------------------------------------------------------------------------

const sleep = (msToWait: number) => new Promise((resolve) => setTimeout(resolve, msToWait));

/** Every part of the section, in order; a part that fails says so in a row of its own and the rest still run. */
export async function benchHostile(o: HostileOptions): Promise<HostileRow[]> {
  const rows: HostileRow[] = [];
  const parts: [string, (o: HostileOptions) => Promise<HostileRow[]>][] = [
    ["input", inputFloods],
    ["output", outputFloods],
    ["versions", versionChurn],
    ["definitions", definitionMemory],
    ["puts", putCosts],
  ];
  // BENCH_HOSTILE_PARTS=input,puts: only those parts.
  const only = Deno.env.get("BENCH_HOSTILE_PARTS")?.split(",");
  for (const [name, part] of parts) {
    if (only && !only.includes(name)) continue;
    try {
      rows.push(...await part(o));
    } catch (error) {
      o.progress(`hostile: ${name} failed: ${(error as Error).stack ?? error}`);
      rows.push({ benchmark: `hostile: ${name}`, result: `FAILED: ${(error as Error).message}`, value: NaN });
    }
  }
  return rows;
}
