/**
 * A CPU profile of the real API process under load: `main.ts api` with the
 * permission set its task derives, started with `--cpu-prof`, loaded by
 * `wrk` (64 connections, a unique Idempotency-Key per POST) for a while, then
 * stopped with SIGTERM so that V8 writes the profile. Prints the functions
 * with the most samples, by self time and by inclusive time, as shares of
 * the non-idle samples taken while the load ran.
 *
 * Usage: deno task bench:profile [--seconds=15] [--top=30] [--out=DIR] [--runs] [--tenants=N] [--warm=S]
 * (`--warm`: seconds of load before the profiled part, 3 by default, 12 from 1,000 tenants.)
 * (`--runs`: `POST /v1/tasks/triage/runs` of the run benchmarks' task instead of `POST /v1/summaries`;
 * `--tenants=N`: as the lanes-intake bench part loads it, `AUTH_MODE=trusted-header` and each POST's
 * `X-Tenant-Id` one of N tenants at random, each with a key.)
 * (BENCH_DATABASE_URL and BENCH_REDIS_URL as for the bench; the process uses
 * an empty Redis database index of BENCH_REDIS_URL, since its key names are fixed.)
 */
import { parseConfig } from "../../src/config.ts";
import { permissionFlags } from "../../src/permissions.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { createScratchDatabase, emptyRedisDatabase, releaseRedisDatabase } from "../support/scratch.ts";
import { freePort } from "../support/free_port.ts";
import { postLoad } from "./wrk.ts";
import { fmt } from "./stats.ts";
import { RUN_BODY, TRIAGE_BODIES } from "./triage_task.ts";

const MAIN = decodeURIComponent(new URL("../../main.ts", import.meta.url).pathname);
const ROOT = decodeURIComponent(new URL("../../", import.meta.url).pathname);
const MIGRATIONS = decodeURIComponent(new URL("../../migrations/", import.meta.url).pathname);

/** One node of a `.cpuprofile` (Chrome DevTools' format, as V8 writes it). */
interface ProfileNode {
  id: number;
  callFrame: { functionName: string; url: string; lineNumber: number };
  hitCount?: number;
  children?: number[];
}

/** A `.cpuprofile` file. */
export interface CpuProfile {
  nodes: ProfileNode[];
  samples: number[];
  timeDeltas: number[];
  startTime: number;
}

/** One function's share of the samples. */
export interface FunctionShare {
  name: string;
  selfPct: number;
  totalPct: number;
}

/** With `--tenants=N`: the tenants' names (1 to N after it) and the gateway's secret. */
const TENANT_PREFIX = "lane-";
const GATEWAY_SECRET = "bench-gateway-secret-0123456789";

const IDLE = new Set(["(idle)", "(program)"]);

/** Names a frame `function file:line`, the file relative to the repository (or the npm package's path). */
function frameName({ functionName, url, lineNumber }: ProfileNode["callFrame"]): string {
  let file = url.replace(`file://${ROOT}`, "");
  const npm = /\/npm\/registry\.npmjs\.org\/(.+)$/.exec(file);
  if (npm) file = `npm:${npm[1]}`;
  return `${functionName || "(anonymous)"} ${file ? `${file}:${lineNumber + 1}` : ""}`.trim();
}

/**
 * Self and inclusive sample shares per function, over the samples taken from `fromUs` on (the profile's own
 * clock, µs from its start), idle samples left out. A function on a stack twice counts once there.
 */
export function functionShares(profile: CpuProfile, fromUs = 0): FunctionShare[] {
  const byId = new Map(profile.nodes.map((n) => [n.id, n]));
  const parent = new Map<number, number>();
  for (const n of profile.nodes) for (const c of n.children ?? []) parent.set(c, n.id);
  const self = new Map<string, number>();
  const total = new Map<string, number>();
  let counted = 0;
  let t = 0;
  for (let i = 0; i < profile.samples.length; i++) {
    t += profile.timeDeltas[i] ?? 0;
    if (t < fromUs) continue;
    const leaf = byId.get(profile.samples[i]!)!;
    if (IDLE.has(leaf.callFrame.functionName)) continue;
    counted++;
    const leafName = frameName(leaf.callFrame);
    self.set(leafName, (self.get(leafName) ?? 0) + 1);
    const onStack = new Set<string>();
    for (let id: number | undefined = leaf.id; id !== undefined; id = parent.get(id)) {
      onStack.add(frameName(byId.get(id)!.callFrame));
    }
    for (const name of onStack) total.set(name, (total.get(name) ?? 0) + 1);
  }
  return [...total.entries()].map(([name, n]) => ({
    name,
    selfPct: (100 * (self.get(name) ?? 0)) / Math.max(1, counted),
    totalPct: (100 * n) / Math.max(1, counted),
  }));
}

if (import.meta.main) {
  const arg = (name: string, fallback: string) =>
    Deno.args.find((a) => a.startsWith(`--${name}=`))?.slice(name.length + 3) ?? fallback;
  const seconds = Number(arg("seconds", "15"));
  const top = Number(arg("top", "30"));
  const out = arg("out", await Deno.makeTempDir({ prefix: "oncely-api-profile-" }));
  const adminUrl = Deno.env.get("BENCH_DATABASE_URL") ?? "postgres://postgres@127.0.0.1:5432/postgres";
  const redisUrl = await emptyRedisDatabase(Deno.env.get("BENCH_REDIS_URL") ?? "redis://127.0.0.1:6379/0");
  const db = await createScratchDatabase(adminUrl, { prefix: "oncely_bench" });
  const tenants = Number(arg("tenants", "0"));
  const key = await createApiKey(db.sql, "bench");
  for (let start = 1; start <= tenants; start += 200) {
    const count = Math.min(200, tenants - start + 1);
    await Promise.all(Array.from({ length: count }, (_, k) => createApiKey(db.sql, `${TENANT_PREFIX}${start + k}`)));
  }
  const port = freePort();
  const env: Record<string, string> = {
    DATABASE_URL: db.url,
    REDIS_URL: redisUrl,
    PORT: String(port),
    LOG_LEVEL: "info",
    NO_COLOR: "1",
    ...(tenants > 0 ? { AUTH_MODE: "trusted-header", GATEWAY_SECRET: GATEWAY_SECRET } : {}),
  };
  const child = new Deno.Command(Deno.execPath(), {
    args: [
      "run",
      "--cpu-prof",
      `--cpu-prof-dir=${out}`,
      ...permissionFlags("api", parseConfig(env), MIGRATIONS),
      MAIN,
      "api",
    ],
    env,
    stdout: "null",
    stderr: "piped",
  }).spawn();
  // Its log lines go down a pipe, read and dropped here, as a log shipper (journald, docker) reads them.
  const drained = child.stderr.pipeTo(new WritableStream());
  try {
    const base = `http://127.0.0.1:${port}`;
    for (let i = 0; !(await fetch(`${base}/healthz`).then((r) => (r.body?.cancel(), r.ok), () => false)); i++) {
      if (i > 300) throw new Error("the API did not start");
      await new Promise((r) => setTimeout(r, 100));
    }
    const headers: Record<string, string> = tenants > 0
      ? { "x-gateway-secret": GATEWAY_SECRET, "content-type": "application/json" }
      : { authorization: `Bearer ${key}`, "content-type": "application/json" };
    const spread = tenants > 0 ? { header: "x-tenant-id", prefix: TENANT_PREFIX, count: tenants } : undefined;
    const runs = Deno.args.includes("--runs");
    if (runs) {
      const put = await fetch(`${base}/v1/tasks/triage`, {
        method: "PUT",
        headers,
        body: JSON.stringify(TRIAGE_BODIES.text),
      });
      if (put.status !== 201) throw new Error(`PUT /v1/tasks/triage answered ${put.status}: ${await put.text()}`);
      await put.body?.cancel();
    }
    const load = {
      url: runs ? `${base}/v1/tasks/triage/runs` : `${base}/v1/summaries`,
      headers,
      body: runs ? RUN_BODY : JSON.stringify({
        text: "Revenue rose 12% in Q3. Costs fell. The board approved the expansion plan for next year.",
        notify: "ops@example.com",
      }),
      connections: 64,
      expectStatus: 202,
      spread,
    };
    const runId = crypto.randomUUID().slice(0, 8);
    const started = performance.now();
    await postLoad({
      ...load,
      // At thousands of tenants 3 s meets many only in the load measured, each first POST waiting for Postgres (over a
      // thousand queries a second at 20,000 tenants): 12 s meets nearly all of them first.
      seconds: Number(arg("warm", tenants >= 1_000 ? "12" : "3")),
      vary: { header: "idempotency-key", prefix: `warm-${runId}-` },
    });
    const warmMs = performance.now() - started;
    const result = await postLoad({ ...load, seconds, vary: { header: "idempotency-key", prefix: `prof-${runId}-` } });
    console.log(
      `${fmt(result.perSecond)} POST/s, p50 ${fmt(result.p50, 1)} ms, p99 ${fmt(result.p99, 1)} ms, ` +
        `${result.errors} errors (${result.generator})`,
    );
    child.kill("SIGTERM");
    await child.status;
    await drained;
    const file = [...Deno.readDirSync(out)].find((e) => e.name.endsWith(".cpuprofile"));
    if (!file) throw new Error(`no .cpuprofile in ${out}`);
    const profile = JSON.parse(await Deno.readTextFile(`${out}/${file.name}`)) as CpuProfile;
    // The samples of the measured load only: the process's start and the warm-up are left out. The profile's
    // clock starts at the process's start; the API answered /healthz within a second or so of it.
    const elapsedUs = profile.timeDeltas.reduce((n, d) => n + d, 0);
    const fromUs = elapsedUs - (seconds * 1000 + 500) * 1000;
    const shares = functionShares(profile, Math.max(0, fromUs));
    console.log(`profile: ${out}/${file.name} (warm-up ${fmt(warmMs / 1000, 1)} s excluded)`);
    console.log("\nby self time:");
    for (const s of [...shares].sort((a, b) => b.selfPct - a.selfPct).slice(0, top)) {
      console.log(`${s.selfPct.toFixed(1).padStart(5)}%  ${s.name}`);
    }
    console.log("\nby inclusive time (our modules):");
    for (
      const s of [...shares].filter((s) => /\bsrc\//.test(s.name)).sort((a, b) => b.totalPct - a.totalPct).slice(0, top)
    ) {
      console.log(`${s.totalPct.toFixed(1).padStart(5)}%  ${s.name}`);
    }
  } finally {
    try {
      child.kill("SIGTERM");
    } catch { /* already gone */ }
    await child.status;
    await releaseRedisDatabase(redisUrl).catch(() => {});
    await db.close();
  }
}
