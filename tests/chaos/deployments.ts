/**
 * `deno task chaos --deployments`: the model calls go to three deployments (`LLM_DEPLOYMENTS`), each a fake
 * provider of its own on loopback speaking OpenAI's wire format, with its own key (`LLM_KEY_*`), its own rate limit
 * advertised in `x-ratelimit-*` headers (the workers learn it) and refused above it with `429
 * rate_limit_exceeded`, and the chaos run's scripted faults (429s, 503s, hangs, poison documents) on top:
 *
 * - `alpha` (weight 2) and `beta` (weight 1) serve `primary`, the default model: every summary's;
 * - `gamma` serves `backup`, the task's fallback: the runs' task lists `["primary", "backup"]`.
 *
 * During the kill period `alpha` goes down in a 503 outage, recovers, and then runs out of quota
 * (`insufficient_quota`); during the quota outage `beta` is also down for a while (503), so `primary` is
 * unavailable and the runs fall back to `backup` while the summaries wait. The checks, besides the chaos run's
 * (nothing lost or duplicated, nothing dead-lettered but the poison jobs): the calls each outage received are bounded
 * by the breaker (its evidence, the calls already granted, one probe per cooldown); `alpha` serves again once it is
 * back; no summary is ever sent to `backup`; no process calls the model OPENAI_* would name. The report gives what
 * each deployment served and how many runs fell back.
 */
import type { Sql } from "postgres";
import { sleep } from "../../src/async/timeout.ts";
import { type DeploymentEntry, deploymentsEnv } from "../support/deployments_env.ts";
import {
  type ChatBody,
  type FakeModelServer,
  type LimitedProvider,
  limitedProvider,
  type ModelBehaviour,
  type Outage,
  startFakeModel,
} from "../support/fake_model_server.ts";

/** The model every summary and every run asks for first, and the runs' fallback. */
export const PRIMARY = "primary", BACKUP = "backup";
/** The `model` of the task the chaos run PUTs in this mode. */
export const TASK_MODELS = [PRIMARY, BACKUP];

/** The deployments: name, models, weight, and the limit each fake provider enforces (requests a second). */
const SPECS = [
  { name: "alpha", models: [PRIMARY], weight: 2, rps: 20 },
  { name: "beta", models: [PRIMARY], weight: 1, rps: 15 },
  { name: "gamma", models: [BACKUP], weight: 1, rps: 10 },
] as const;
type Name = typeof SPECS[number]["name"];

/** The outages, as shares of the kill period. */
const SCHEDULE: { deployment: Name; outage: Exclude<Outage, null>; from: number; to: number }[] = [
  { deployment: "alpha", outage: "503", from: 0.2, to: 0.4 },
  { deployment: "alpha", outage: "quota", from: 0.55, to: 0.8 },
  { deployment: "beta", outage: "503", from: 0.65, to: 0.75 },
];

/**
 * The calls an outage may receive: those that make the breaker open (three failing jobs for a 503, one for a
 * quota refusal) plus the calls granted before it opened, which the deployments test bounds at 8 in all, then one
 * probe per cooldown, and one more probe in flight when the outage ends.
 */
const OPENING_CALLS = 8;

/** How one request to a deployment was answered. */
type Answer = "ok" | "limit" | "outage" | "fault";

/** One request a deployment received. */
interface Call {
  at: number;
  model: string;
  /** A run's call (structured output), not a summary's. */
  run: boolean;
  answer: Answer;
}

/** One deployment: its fake provider, its limit, and what it received. */
interface Deployment {
  name: Name;
  entry: DeploymentEntry;
  server: FakeModelServer;
  limited: LimitedProvider;
  calls: Call[];
}

/** One outage as it happened (performance.now()). */
interface Window {
  deployment: Name;
  outage: Exclude<Outage, null>;
  start: number;
  end: number;
}

/** What {@linkcode chaosDeployments} is given. */
export interface ChaosDeploymentsOptions {
  /** How the chaos run answers a request its deployment's limit let through (faults, poison, structured answers). */
  answer(body: ChatBody, prompt: string, headers: Record<string, string> | undefined): ModelBehaviour;
  /** LLM_BREAKER_COOLDOWN_S, in ms: the longest wait between probes. */
  cooldownMs: number;
  /** The chaos run's kill period, in ms. */
  durationMs: number;
}

/** The three deployments, their outages, and the report: see the module's comment. */
export function chaosDeployments({ answer, cooldownMs, durationMs }: ChaosDeploymentsOptions) {
  const deployments: Deployment[] = SPECS.map((spec) => {
    const limited = limitedProvider({ rps: spec.rps });
    const calls: Call[] = [];
    const server: FakeModelServer = startFakeModel((n, prompt) => {
      const body = server.bodies[n - 1] as ChatBody;
      const call: Call = {
        at: performance.now(),
        model: body.model ?? "",
        run: body.response_format?.type === "json_schema",
        answer: "ok",
      };
      calls.push(call);
      const gate = limited.respond(n, prompt);
      if (gate.kind !== "ok") {
        // Over its limit (rate_limit_exceeded), or in an outage (insufficient_quota, a 503).
        const code = gate.kind === "status" ? (gate.body as { error?: { code?: string } }).error?.code : undefined;
        call.answer = code === "rate_limit_exceeded" ? "limit" : "outage";
        return gate;
      }
      const behaviour = answer(body, prompt, gate.headers);
      if (behaviour.kind !== "ok") call.answer = "fault";
      return behaviour;
    });
    const entry: DeploymentEntry = {
      name: spec.name,
      base_url: server.url,
      api_key_env: `LLM_KEY_${spec.name.toUpperCase()}`,
      models: [...spec.models],
      weight: spec.weight,
    };
    return { name: spec.name, entry, server, limited, calls };
  });
  const byName = (name: Name) => deployments.find((d) => d.name === name)!;
  const windows: Window[] = [];
  let report: { rows: [string, string][]; problems: string[] } | undefined;

  /** The calls `d` received between `from` and `to` (performance.now()). */
  const between = (d: Deployment, from: number, to: number) => d.calls.filter((c) => c.at >= from && c.at < to);

  return {
    /** LLM_DEPLOYMENTS and each deployment's key variable, for every process. */
    env: deploymentsEnv(deployments.map((d) => d.entry)),
    /** Requests the deployments received. */
    calls: () => deployments.reduce((sum, d) => sum + d.server.requests, 0),
    /** The fake providers, for the requests each received. */
    servers: (): FakeModelServer[] => deployments.map((d) => d.server),
    /** One line for the run's mode. */
    describe: () =>
      `deployments ${
        SPECS.map((s) => `${s.name} (${s.models.join(", ")}; weight ${s.weight}, ${s.rps}/s)`).join(", ")
      }`,

    /** Switches the outages on and off on schedule until `end` (performance.now()), noting each in `events`. */
    async outages(end: number, events: string[]): Promise<void> {
      const open = new Map<string, Window>();
      while (performance.now() < end) {
        const elapsed = 1 - (end - performance.now()) / durationMs;
        for (const d of deployments) {
          const due = SCHEDULE.find((s) => s.deployment === d.name && elapsed >= s.from && elapsed < s.to);
          const current = open.get(d.name);
          if (current && current.outage !== due?.outage) {
            current.end = performance.now();
            open.delete(d.name);
          }
          if (due && !open.has(d.name)) {
            const w: Window = { deployment: d.name, outage: due.outage, start: performance.now(), end: Infinity };
            windows.push(w);
            open.set(d.name, w);
            events.push(`deployment ${d.name}: ${due.outage === "quota" ? "insufficient_quota" : "503"} outage`);
          }
          d.limited.setOutage(due?.outage ?? null);
        }
        await sleep(50);
      }
      for (const w of open.values()) w.end = performance.now();
      for (const d of deployments) d.limited.setOutage(null);
    },

    /** Reads what the run did, once it is over: the rows of the report and what failed. */
    async finish(sql: Sql, unconfigured: FakeModelServer): Promise<void> {
      const rows: [string, string][] = [];
      const problems: string[] = [];
      for (const d of deployments) {
        const count = (a: Answer) => d.calls.filter((c) => c.answer === a).length;
        const ok = d.calls.filter((c) => c.answer === "ok");
        rows.push([
          `deployment ${d.name}: calls / answered (summaries, runs) / 429 over its limit / outage answers / scripted faults and poison hangs`,
          `${d.calls.length} / ${ok.length} (${ok.filter((c) => !c.run).length}, ${ok.filter((c) => c.run).length}) / ${
            count("limit")
          } / ${count("outage")} / ${count("fault")}`,
        ]);
      }
      for (const w of windows) {
        const d = byName(w.deployment);
        const seconds = (w.end - w.start) / 1000;
        const calls = between(d, w.start, w.end);
        const bound = OPENING_CALLS + Math.ceil((w.end - w.start) / cooldownMs) + 1;
        const first = calls.filter((c) => c.at < w.start + 1_000).length;
        rows.push([
          `${w.deployment} in a ${w.outage} outage for ${
            seconds.toFixed(1)
          } s: calls to it (first second, after) / bound`,
          `${calls.length} (${first}, ${calls.length - first}) / ${bound}`,
        ]);
        if (calls.length > bound) {
          problems.push(`${w.deployment} received ${calls.length} calls in its ${w.outage} outage (bound ${bound})`);
        }
      }
      // Once alpha's 503 outage is over and before its next one, it takes its share of primary again.
      const [down, next] = windows.filter((w) => w.deployment === "alpha");
      if (down && next) {
        const served = (d: Name) =>
          between(byName(d), down.end, next.start).filter((c) => c.answer === "ok" && c.model === PRIMARY).length;
        const alpha = served("alpha"), beta = served("beta");
        const back = byName("alpha").calls.find((c) => c.at >= down.end && c.answer === "ok");
        // A probe that meets a poison hang or a scripted fault fails for the document, not for alpha: in a gap of
        // 3 s, one such probe (1 s to time out) and the cooldown after it (1 s) can leave no room for another.
        const faulted = between(byName("alpha"), down.end, next.start).filter((c) => c.answer === "fault").length;
        rows.push([
          `alpha back (${((next.start - down.end) / 1000).toFixed(1)} s between outages): primary calls answered by ` +
          `alpha / beta (first after ${back ? ((back.at - down.end) / 1000).toFixed(1) : "-"} s) / alpha's calls ` +
          `that met a scripted fault or hang`,
          `${alpha} / ${beta}${
            alpha + beta ? ` (${Math.round((100 * alpha) / (alpha + beta))}% alpha, weight 67%)` : ""
          } / ${faulted}`,
        ]);
        if (alpha === 0 && beta > 0 && faulted === 0) {
          problems.push(
            "alpha served no call between its outages, and no probe of it met a bad document: it never came back",
          );
        }
      }
      // Primary was wholly out while both of its deployments were: the runs' fallback then, and only then.
      const alphaQuota = windows.find((w) => w.deployment === "alpha" && w.outage === "quota");
      const beta503 = windows.find((w) => w.deployment === "beta");
      const gamma = byName("gamma");
      const backupOk = gamma.calls.filter((c) => c.answer === "ok");
      const summariesToBackup = deployments.flatMap((d) => d.calls).filter((c) => c.model === BACKUP && !c.run).length;
      const [fell] = await sql<{ runs: number; done: number }[]>`
        SELECT (SELECT count(*) FROM run_results WHERE model = ${BACKUP})::int AS runs,
               (SELECT count(*) FROM run_results)::int AS done`;
      let during = "";
      if (alphaQuota && beta503) {
        const from = Math.max(alphaQuota.start, beta503.start), to = Math.min(alphaQuota.end, beta503.end);
        // Runs asking during the outage may be answered by backup up to a call's timeout after it ends.
        const inside = backupOk.filter((c) => c.at >= from && c.at < to + 2_000).length;
        during = `; calls answered by backup while primary was out (${((to - from) / 1000).toFixed(1)} s, +2 s) / ` +
          `at other times: ${inside} / ${backupOk.length - inside}`;
      }
      rows.push([
        "runs done on the fallback model backup / runs done (summaries sent to backup)",
        `${fell!.runs} / ${fell!.done} (${summariesToBackup})${during}`,
      ]);
      if (summariesToBackup > 0) {
        problems.push(`${summariesToBackup} summary calls went to ${BACKUP}: they have no fallback`);
      }
      if (unconfigured.requests > 0) {
        problems.push(`${unconfigured.requests} calls went to the OPENAI_* model, which LLM_DEPLOYMENTS replaces`);
      }
      const attempts = await sql<{ deployment: string; model: string; outcome: string; n: number }[]>`
        SELECT deployment, model, outcome, count(*)::int AS n FROM model_attempts GROUP BY 1, 2, 3 ORDER BY 1, 2, 3`;
      const grouped = new Map<string, string[]>();
      for (const a of attempts) {
        const key = `${a.deployment} ${a.model}`;
        grouped.set(key, [...(grouped.get(key) ?? []), `${a.outcome} ${a.n}`]);
      }
      rows.push([
        "model_attempts by deployment and model (kills lose some rows)",
        [...grouped].map(([k, v]) => `${k}: ${v.join(", ")}`).join("; "),
      ]);
      report = { rows, problems };
    },

    /** The report's rows (after `finish`). */
    rows: (): [string, string][] => report?.rows ?? [],
    /** What failed (after `finish`). */
    problems: (): string[] => report ? report.problems : ["the deployments' report was never read"],
    ok(): boolean {
      return this.problems().length === 0;
    },
    async close(): Promise<void> {
      for (const d of deployments) await d.server.close();
    },
  };
}

/** What {@linkcode chaosDeployments} returns. */
export type ChaosDeployments = ReturnType<typeof chaosDeployments>;
