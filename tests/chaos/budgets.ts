/**
 * `deno task chaos --budgets`: the chaos run with two of its tenants on a
 * budget, one in tokens per UTC day (`chaos-b`) and one in USD per UTC day
 * (`chaos-c`), each set with the real `tenant budget` command before the
 * processes start and worth the worst case of one call plus what the
 * provider bills for {@linkcode BUDGET_SHARE} of the tenant's jobs. Each
 * budgeted tenant posts its first {@linkcode BURST_SHARE} of jobs at once as
 * the kill period starts (a runaway integration), the rest spread over it as
 * usual: the burst is accepted, spends the budget partway through the kill
 * period, and what is left of it waits for the budget.
 *
 * The fake model reports usage counted from each request and its answer
 * (`realisticUsage`), and the run keeps its own ledger of what the provider
 * reported per tenant (in tokens, and at the run's prices in nano-dollars,
 * rounded up per call as the service does). While the budgets stand, a
 * budgeted tenant's new POSTs are answered `429` `Budget exhausted` with
 * `Retry-After` and the budget: such a key is refused, not accepted (half of
 * the refused clients come back with the same key after the raise, half give
 * up: a given-up key must have left nothing, or, if an earlier POST of it
 * that got no answer was taken in, be done once). A key already answered
 * `202` must never be answered `429`.
 *
 * At {@linkcode RAISE_AT} of the kill period the run checks, before raising
 * anything: every budgeted tenant was stopped by its budget (refused at
 * intake, or runs waiting for it: a reservation left by a call whose worker
 * was killed counts against the budget until the period ends, and intake,
 * which counts only what is spent, may still accept what the worker then
 * holds back); its queued runs say `waiting_for: "budget"` (`GET
 * /v1/runs/{id}`, sampled until one pass sees every one of them say so,
 * within 10 s; at least one such run must have been seen); none of its jobs
 * is dead-lettered but the poison ones; and the budget's spend plus its
 * reservations are within the limit. Then it raises both budgets with the
 * same command, and every accepted job must finish. Afterwards: the provider
 * reported at most the budget for every call that reached it before the
 * raise (0 overshoot: a call reaches the provider only after its
 * reservation, so none of those was reserved under the raised limit), and
 * the budget's spend plus reservations covers every token and nano-dollar
 * the provider reported (calls that hung or whose worker was killed are
 * charged their reservation, which only makes the budget more conservative).
 *
 * With `reconcile` (`--redis-drops`, whose workers lose Redis replies and
 * whose budget scripts may therefore run twice), the end is checked exactly,
 * once the calls are over (no provider request for a few seconds, the last
 * one past the call timeout): each budget's spend against what the settled
 * calls cost by the provider's own count, within 2%, and what is still
 * reserved against what the calls a kill cut off may hold. A call is settled
 * when the service recorded it in `model_attempts` (which it does right after
 * the settlement): a row naming the provider's request id was charged that
 * request's usage; a row without usage but with a cost was charged its
 * reservation (a timeout after the call was sent), matched to its provider
 * request by its job and its worst case; a row with neither was charged
 * nothing (a refused call). A provider request no row accounts for was cut
 * off by a kill: its reservation may still be held (until its epoch ends), or
 * its worker settled it and died before the record was written; either is
 * allowed, nothing else is. Without kills of workers that leaves no slack:
 * spend = the settled calls' cost, nothing reserved.
 *
 * Kept apart from run.ts, which calls these hooks.
 */
import type { Sql } from "postgres";
import { sleep } from "../../src/async/timeout.ts";
import type { RedisClient } from "../../src/clients.ts";
import { worstCaseTokens } from "../../src/budgets/budgets.ts";
import type { CallTokens } from "../../src/budgets/charge.ts";
import { readBudgetState } from "../../src/budgets/read_script.ts";
import { MAX_OUTPUT_TOKENS } from "../../src/llm/llm.ts";
import { costNanos, nanosToUsd, type Prices, usdToNanos } from "../../src/llm/prices.ts";
import { listDeadLetters } from "../../src/queue/dead_letter.ts";
import type { ServiceKeys } from "../../src/runs/keys.ts";
import { type ChatBody, defaultAnswer, type FakeModelServer, realisticUsage } from "../support/fake_model_server.ts";

/** The budgeted tenants and the unit of each one's budget (per UTC day). */
export const BUDGETED = { "chaos-b": "tokens", "chaos-c": "usd" } as const;
type Budgeted = keyof typeof BUDGETED;
/** What every model costs in this mode (gpt-4.1-mini's list price), so a USD budget means something. */
export const PRICE_ENV = { LLM_PRICE_IN_PER_MTOK: "0.4", LLM_PRICE_OUT_PER_MTOK: "1.6" };
/** A budget is worth one call's worst case plus what the provider bills for this share of the tenant's jobs. */
const BUDGET_SHARE = 0.4;
/**
 * The share of a budgeted tenant's jobs (its first ones) posted all at once when the kill period starts, as a
 * runaway integration would: more than the budget is worth, so some are accepted and then wait for the budget.
 */
const BURST_SHARE = 0.7;
/** When in the kill period the budgets are checked and raised. */
export const RAISE_AT = 0.85;
/** The raised budgets: far beyond what the run can spend. */
const RAISED = { tokens: "1000000000", usd: "1000" };
/** How long after the raise a new POST may still be answered 429 (every process reads limits within 2 s). */
const RAISE_GRACE_MS = 10_000;
/** How long the check before the raise waits for a sample in which every queued run says `waiting_for`. */
const WAITING_SAMPLE_MS = 10_000;
/** With `reconcile`: how long without a new provider request counts as "the calls are over", and the most to wait. */
const QUIET_MS = 3_000, QUIET_BOUND_MS = 60_000;
/** With `reconcile`: how far the spend may be from what the settled calls cost (by the provider's count). */
const SPEND_TOLERANCE = 0.02;

/** How the fake provider answered a request: billed (`ok`), refused with a status, or left hanging. */
export type RequestKind = "ok" | "status" | "hang";

/** One job of the run, as the budgets see it. */
export interface BudgetJob {
  tenant: string;
  /** The request the worker sends for it (its first call). */
  body: ChatBody;
}

/** What the mode needs from the run. */
export interface BudgetDeps {
  sql: Sql;
  redis: RedisClient;
  keys: ServiceKeys;
  prices: Prices;
  model: FakeModelServer;
  /** Every job of the run, by index. */
  jobs: BudgetJob[];
  /** The job a provider request is for (its first user message names it), or undefined. */
  jobOf(body: ChatBody): number | undefined;
  /** Runs `main.ts tenant ARGS...` as `deno task tenant` would; @returns its stdout. @throws on a non-zero exit. */
  tenantCommand(args: string[]): Promise<string>;
  /** GETs a path of the API as `tenant`: status and JSON body, or null without an answer. */
  get(tenant: string, path: string): Promise<{ status: number; body: Record<string, unknown> } | null>;
  /** When the kill period began (performance.now()). */
  start(): number;
  /** Reconciles each budget with the provider's ledger and the service's record at the end (see the header). */
  reconcile?: {
    /** How the provider answered request n (1-based), as the run scripted it. */
    kindOf(n: number): RequestKind | undefined;
    /** The job index of a job id the service recorded. */
    jobIndexOf(jobId: string): number | undefined;
    /** LLM_CALL_TIMEOUT_S in ms: a hung call ends (and is settled) this long after it was sent. */
    callTimeoutMs: number;
  };
}

/** A budget's end state against the provider's ledger and the service's record (`reconcile`), in its unit. */
interface Reconciled {
  /** Settled calls, by what they were charged: the provider's count, their reservation, nothing. */
  settled: { reported: number; reservation: number; nothing: number };
  /** What the settled calls cost: the provider's count for those it billed, the reservation for the others. */
  expected: number;
  /** The provider's count for every call it billed (settled or not). */
  billed: number;
  /** Provider requests no row accounts for (their worker killed mid-call), by how the provider answered. */
  cutOff: { ok: number; hang: number; status: number };
  /** What those may have added to the spend (had their settlement landed), and what they may still hold reserved. */
  cutOffSpentAtMost: number;
  cutOffHeldAtMost: number;
  /** Rows charged a reservation that matched no provider request of their job. */
  unmatched: number;
  /** Rows whose reported tokens differ from the provider's count for the request they name. */
  disagreeing: number;
}

/** A refused tenant's budget at the raise, and the provider's ledger for it. */
interface TenantReport {
  tenant: Budgeted;
  unit: "tokens" | "usd";
  /** The limit as set, in tokens or nano-USD. */
  limit: number;
  /** How many of the tenant's jobs the limit is worth, by the estimate it was sized with. */
  worthJobs: number;
  jobs: number;
  /** The budget's spend and reservations just before the raise (tokens or nano-USD). */
  atRaise?: { spent: number; reserved: number };
  /** At the end of the run. */
  atEnd?: { spent: number; reserved: number };
  /** Queued jobs just before the raise: runs, runs saying `waiting_for: "budget"`, summaries. */
  queuedRuns: number;
  waitingRuns: number;
  queuedSummaries: number;
  /** The tenant's dead letters at the raise that are not poison. */
  deadNotPoison: number;
  /** performance.now() of its first 429 at intake. */
  firstRefusalAt?: number;
  /** The smallest worst case of its jobs' calls: once spent + this passes the limit, no new job fits. */
  smallestWorst: number;
  /** performance.now() when the budget was first seen spent (no new job fits), by {@linkcode ChaosBudgets.poll}. */
  spentAt?: number;
  /** 429s answered, and the Retry-After values seen. */
  refusals: number;
  retryAfter: number[];
  /** With `reconcile`: the end state against the ledger and the record. */
  reconciled?: Reconciled;
}

/** The mode's state and its steps, as run.ts calls them. */
export interface ChaosBudgets {
  /** Sets the budgets with `tenant budget` (before the processes start). */
  setUp(): Promise<void>;
  /** Reads the budgets, to see when each is first spent (call every 250 ms or so). */
  poll(): Promise<void>;
  /**
   * A POST's 429, as the client sees it: @returns true when it is a budget refusal of a budgeted tenant (the
   * key is refused), after checking its problem document; false for anything else (the caller fails the run).
   */
  refusal(tenant: string, key: string, sentAt: number, res: Response, text: string): boolean;
  /** Notes that `key` was answered 202 at `at`. */
  acceptedAt(key: string, at: number): void;
  /** Whether a refused client comes back with its key after the raise (every other one does). */
  comesBack(): boolean;
  /** Whether the budgets have been raised yet. */
  readonly raised: boolean;
  /**
   * At {@linkcode RAISE_AT} of the kill period: checks the budgeted tenants (see the module's header), then
   * raises their budgets. `accepted`: every accepted job; `poison`: the poison jobs' ids.
   */
  raise(
    accepted: { tenant: string; jobId: string; run: boolean }[],
    poison: Set<string>,
  ): Promise<void>;
  /** How long after the raise a 429 may still come (the processes' 2 s cache of limits): then it is a failure. */
  graceOver(): boolean;
  /** Reads the budgets at the end of the run. */
  finish(): Promise<void>;
  rows(): [string, string][];
  ok(): boolean;
  problems(): string[];
}

/** The jobs posted at once when the kill period starts: each budgeted tenant's first {@linkcode BURST_SHARE}. */
export function burstJobs(tenants: readonly string[]): Set<number> {
  const burst = new Set<number>();
  for (const tenant of Object.keys(BUDGETED)) {
    const mine = tenants.flatMap((t, i) => (t === tenant ? [i] : []));
    for (const i of mine.slice(0, Math.round(mine.length * BURST_SHARE))) burst.add(i);
  }
  return burst;
}

/** Creates the mode's state. */
export function chaosBudgets(deps: BudgetDeps): ChaosBudgets {
  const reports = new Map<Budgeted, TenantReport>();
  const acceptedKeys = new Map<string, number>();
  const problems: string[] = [];
  let raisedAt: number | undefined, raisedWall: number | undefined, refusedClients = 0;
  let refusedOther = 0, malformed = 0, refusedAccepted = 0;
  let lastDoneAfterRaiseS: number | null = null;
  const priceOf = (body: ChatBody) => deps.prices.of(body.model ?? "");
  const nanosOf = (body: ChatBody, prompt: number, completion: number) => {
    const price = priceOf(body);
    if (!price) throw new Error(`no price for model ${body.model}`);
    return costNanos(price, prompt, completion);
  };
  const isBudgeted = (tenant: string): tenant is Budgeted => Object.hasOwn(BUDGETED, tenant);
  const index = (unit: "tokens" | "usd") => (unit === "tokens" ? 0 : 1); // tokens/day, nano-USD/day

  /** One call's amount in the budget's unit: tokens, or nano-USD at the run's price. */
  function amount(unit: "tokens" | "usd", body: ChatBody, prompt: number, completion: number): number {
    return unit === "tokens" ? prompt + completion : nanosOf(body, prompt, completion);
  }

  /** What the provider reported for `tenant`: in total, and for the requests that reached it before `before`. */
  function ledger(tenant: Budgeted, before = Infinity) {
    const unit = BUDGETED[tenant];
    let total = 0, early = 0, calls = 0;
    deps.model.usages.forEach((usage, n) => {
      if (!usage) return;
      const body = deps.model.bodies[n] as ChatBody;
      const job = deps.jobOf(body);
      if (job === undefined || deps.jobs[job]?.tenant !== tenant) return;
      const x = amount(unit, body, usage.prompt_tokens, usage.completion_tokens);
      total += x;
      calls++;
      if ((deps.model.arrivedAt[n] ?? Infinity) < before) early += x;
    });
    return { total, early, calls };
  }

  async function state(tenant: Budgeted) {
    const s = await readBudgetState(deps.redis, deps.keys.budget(tenant));
    const i = index(BUDGETED[tenant]);
    return { spent: s.spent[i]!, reserved: s.reserved[i]! };
  }

  const since = (at: number | undefined) => at === undefined ? "never" : `${((at - deps.start()) / 1000).toFixed(1)} s`;
  const show = (unit: "tokens" | "usd", x: number) =>
    unit === "tokens" ? `${x.toLocaleString("en-US")} tokens` : `${nanosToUsd(x).toFixed(6)} USD`;

  return {
    async setUp() {
      for (const tenant of Object.keys(BUDGETED) as Budgeted[]) {
        const unit = BUDGETED[tenant];
        const mine = deps.jobs.filter((j) => j.tenant === tenant);
        // The worst case the service reserves for a job's call, and what the fake provider bills for it.
        let worst = 0, smallestWorst = Infinity;
        const billed = mine.map(({ body }) => {
          const messages = (body.messages ?? []).map((m) => m.content ?? "");
          const w = worstCaseTokens(messages, body.max_completion_tokens ?? MAX_OUTPUT_TOKENS);
          worst = Math.max(worst, amount(unit, body, w.prompt, w.completion));
          smallestWorst = Math.min(smallestWorst, amount(unit, body, w.prompt, w.completion));
          const usage = realisticUsage(body, defaultAnswer(body));
          return amount(unit, body, usage.prompt_tokens, usage.completion_tokens);
        });
        const worth = Math.max(2, Math.round(mine.length * BUDGET_SHARE));
        const sized = worst + billed.slice(0, worth).reduce((a, b) => a + b, 0);
        const flag = unit === "tokens" ? "--tokens-per-day" : "--usd-per-day";
        const value = unit === "tokens" ? String(sized) : nanosToUsd(sized).toFixed(9);
        await deps.tenantCommand(["budget", tenant, flag, value]);
        reports.set(tenant, {
          tenant,
          unit,
          limit: unit === "tokens" ? sized : usdToNanos(Number(value)),
          worthJobs: worth,
          smallestWorst,
          jobs: mine.length,
          queuedRuns: 0,
          waitingRuns: 0,
          queuedSummaries: 0,
          deadNotPoison: 0,
          refusals: 0,
          retryAfter: [],
        });
      }
    },

    async poll() {
      for (const report of reports.values()) {
        if (report.spentAt !== undefined || raisedAt !== undefined) continue;
        const { spent } = await state(report.tenant);
        if (spent + report.smallestWorst > report.limit) report.spentAt = performance.now();
      }
    },

    refusal(tenant, key, sentAt, res, text) {
      let problem: { title?: string; budget?: { period?: string; unit?: string; limit?: number; spent?: number } };
      try {
        problem = JSON.parse(text);
      } catch {
        problem = {};
      }
      if (problem.title !== "Budget exhausted") return false;
      if (!isBudgeted(tenant)) {
        refusedOther++;
        return true;
      }
      const report = reports.get(tenant)!;
      const retryAfter = Number(res.headers.get("retry-after"));
      const b = problem.budget;
      if (
        !(retryAfter >= 1) || b?.period !== "day" || b.unit !== BUDGETED[tenant] ||
        typeof b.limit !== "number" || typeof b.spent !== "number"
      ) malformed++;
      // A replay of an accepted key is answered 202 whatever the budget: a 429 sent after a 202 came is a bug.
      const accepted = acceptedKeys.get(key);
      if (accepted !== undefined && sentAt > accepted) refusedAccepted++;
      report.refusals++;
      report.retryAfter.push(retryAfter);
      report.firstRefusalAt ??= performance.now();
      return true;
    },

    acceptedAt(key, at) {
      if (!acceptedKeys.has(key)) acceptedKeys.set(key, at);
    },

    comesBack() {
      return refusedClients++ % 2 === 0;
    },

    get raised() {
      return raisedAt !== undefined;
    },

    graceOver() {
      return raisedAt !== undefined && performance.now() - raisedAt > RAISE_GRACE_MS;
    },

    async raise(accepted, poison) {
      for (const report of reports.values()) {
        // Nothing of the tenant's is dead-lettered but its poison jobs.
        const dead = await listDeadLetters(deps.redis, deps.keys.lane(report.tenant), 10_000);
        report.deadNotPoison = dead.filter((d) => !poison.has(d.fields.job_id ?? "")).length;
        // Its queued runs wait for the budget: sampled until every one of them says so, or the bound.
        const mine = accepted.filter((a) => a.tenant === report.tenant && !poison.has(a.jobId));
        const done = new Set(
          (await deps.sql<{ job_id: string }[]>`
            SELECT job_id::text FROM job_outcomes WHERE job_id = ANY(${mine.map((a) => a.jobId)}::uuid[])`)
            .map((r) => r.job_id),
        );
        const open = mine.filter((a) => !done.has(a.jobId));
        const end = performance.now() + WAITING_SAMPLE_MS;
        for (let best = -1;;) {
          const docs = await Promise.all(
            open.map((a) => deps.get(report.tenant, a.run ? `/v1/runs/${a.jobId}` : `/v1/summaries/${a.jobId}`)),
          );
          if (docs.every((d) => d !== null)) {
            const runs = docs.filter((d, n) => open[n]!.run && d!.body.status === "queued");
            const waiting = runs.filter((d) => d!.body.waiting_for === "budget").length;
            if (waiting - runs.length > best) {
              best = waiting - runs.length;
              report.queuedRuns = runs.length;
              report.waitingRuns = waiting;
              report.queuedSummaries = docs.filter((d, n) => !open[n]!.run && d!.body.status === "queued").length;
            }
            if (best === 0) break;
          }
          if (performance.now() > end) break;
          await sleep(250);
        }
        report.atRaise = await state(report.tenant);
        // Spent (intake refuses), or held by reservations (the worker waits: intake counts only what is spent).
        if (report.firstRefusalAt === undefined && report.waitingRuns === 0) {
          problems.push(`${report.tenant}'s budget never stopped it before the raise (no 429, no run waiting)`);
        }
      }
      raisedAt = performance.now();
      raisedWall = Date.now();
      for (const report of reports.values()) {
        const flag = report.unit === "tokens" ? "--tokens-per-day" : "--usd-per-day";
        await deps.tenantCommand(["budget", report.tenant, flag, RAISED[report.unit]]);
      }
    },

    async finish() {
      if (deps.reconcile) {
        await callsOver(deps.reconcile.callTimeoutMs);
        for (const report of reports.values()) report.reconciled = await reconcile(report, deps.reconcile);
      }
      for (const report of reports.values()) report.atEnd = await state(report.tenant);
      if (raisedWall === undefined) return;
      const [row] = await deps.sql<{ after: number | null }[]>`
        SELECT extract(epoch FROM max(decided_at) - to_timestamp(${raisedWall / 1000}))::float8 AS after
        FROM job_outcomes WHERE tenant = ANY(${Object.keys(BUDGETED)})`;
      lastDoneAfterRaiseS = row?.after ?? null;
    },

    rows() {
      const rows: [string, string][] = [];
      for (const r of reports.values()) {
        const l = ledger(r.tenant, raisedAt);
        const all = ledger(r.tenant);
        const t = r.tenant;
        rows.push(
          [
            `${t}: budget per UTC day (\`tenant budget ${t} --${r.unit}-per-day\`)`,
            `${show(r.unit, r.limit)}, worth about ${r.worthJobs} of its ${r.jobs} jobs`,
          ],
          [
            `${t}: spent, no new job fits / first 429 at intake (into the kill period) / 429s answered (Retry-After)`,
            `${since(r.spentAt)} / ${since(r.firstRefusalAt)} / ${r.refusals} (${
              r.retryAfter.length ? `${Math.min(...r.retryAfter)}-${Math.max(...r.retryAfter)} s` : "-"
            })`,
          ],
          [
            `${t}: provider reported, calls that reached it before the raise / budget (overshoot)`,
            `${show(r.unit, l.early)} / ${show(r.unit, r.limit)} (${(100 * l.early / r.limit).toFixed(0)}%; ` +
            `overshoot ${show(r.unit, Math.max(0, l.early - r.limit))})`,
          ],
          [
            `${t}: the budget's spent + reserved just before the raise`,
            r.atRaise ? `${show(r.unit, r.atRaise.spent)} + ${show(r.unit, r.atRaise.reserved)}` : "n/a",
          ],
          [
            `${t}: queued just before the raise: runs (saying waiting_for budget) / summaries`,
            `${r.queuedRuns} (${r.waitingRuns}) / ${r.queuedSummaries}`,
          ],
          [`${t}: jobs dead-lettered at the raise, other than poison`, String(r.deadNotPoison)],
          [
            `${t}: provider reported in all (${all.calls} calls) / the budget's spent + reserved at the end`,
            `${show(r.unit, all.total)} / ${
              r.atEnd ? `${show(r.unit, r.atEnd.spent)} + ${show(r.unit, r.atEnd.reserved)}` : "n/a"
            }`,
          ],
          ...(r.reconciled ? reconciledRows(r, r.reconciled) : []),
        );
      }
      rows.push(
        [
          "keys refused 429 at intake: came back after the raise / gave up",
          `${Math.ceil(refusedClients / 2)} / ${Math.floor(refusedClients / 2)}`,
        ],
        [
          "429s to an accepted key / to an unbudgeted tenant / without Retry-After or the budget",
          `${refusedAccepted} / ${refusedOther} / ${malformed}`,
        ],
        [
          "budgets raised (into the kill period) / last budgeted job decided, after the raise",
          `${since(raisedAt)} / ${lastDoneAfterRaiseS === null ? "n/a" : `${lastDoneAfterRaiseS.toFixed(1)} s`}`,
        ],
      );
      return rows;
    },

    ok() {
      return verdict().length === 0;
    },

    problems: () => verdict(),
  };

  /** Everything this mode found wrong. */
  function verdict(): string[] {
    const all = [...problems];
    if (raisedAt === undefined) all.push("the budgets were never raised");
    if (refusedAccepted > 0) all.push(`${refusedAccepted} POST(s) of an already accepted key answered 429`);
    if (refusedOther > 0) all.push(`${refusedOther} POST(s) of an unbudgeted tenant answered 429`);
    if (malformed > 0) all.push(`${malformed} 429(s) without Retry-After or the budget`);
    if (raisedAt !== undefined && [...reports.values()].every((r) => r.waitingRuns === 0)) {
      all.push("no run of a budgeted tenant was seen waiting for its budget before the raise");
    }
    for (const r of reports.values()) {
      const l = ledger(r.tenant, raisedAt);
      const all_ = ledger(r.tenant);
      if (l.early > r.limit) all.push(`${r.tenant}: the provider reported ${l.early} of a budget of ${r.limit}`);
      if (r.atRaise && r.atRaise.spent + r.atRaise.reserved > r.limit) {
        all.push(`${r.tenant}: spent + reserved ${r.atRaise.spent + r.atRaise.reserved} of ${r.limit} at the raise`);
      }
      if (r.atEnd && r.atEnd.spent + r.atEnd.reserved < all_.total) {
        all.push(`${r.tenant}: the budget counted less than the provider reported (${all_.total})`);
      }
      if (r.waitingRuns !== r.queuedRuns) {
        all.push(`${r.tenant}: ${r.queuedRuns - r.waitingRuns} queued run(s) not waiting_for budget at the raise`);
      }
      if (r.deadNotPoison > 0) all.push(`${r.tenant}: ${r.deadNotPoison} job(s) dead-lettered, not poison`);
      if (deps.reconcile) all.push(...reconcileProblems(r));
    }
    return all;
  }

  /** Waits until no provider request came for {@linkcode QUIET_MS} and the last one is past the call timeout. */
  async function callsOver(callTimeoutMs: number): Promise<void> {
    const end = performance.now() + QUIET_BOUND_MS;
    let seen = -1, since = performance.now();
    while (performance.now() < end) {
      if (deps.model.requests !== seen) {
        seen = deps.model.requests;
        since = performance.now();
      }
      const last = deps.model.arrivedAt.at(-1) ?? 0;
      if (performance.now() - since > QUIET_MS && performance.now() - last > callTimeoutMs + QUIET_MS) break;
      await sleep(250);
    }
    // The attempts' record is written in batches (every 200 ms).
    await sleep(1_000);
  }

  /** A call's worst case as the service reserves it: every message it sends, its schema, every output token. */
  function worstOf(body: ChatBody): CallTokens {
    const messages = (body.messages ?? []).map((m) => m.content ?? "");
    const format = body.response_format as { type?: string; json_schema?: { name?: string; schema?: unknown } };
    if (format?.type === "json_schema" && format.json_schema) {
      messages.push((format.json_schema.name ?? "") + JSON.stringify(format.json_schema.schema));
    }
    return worstCaseTokens(messages, body.max_completion_tokens ?? MAX_OUTPUT_TOKENS);
  }

  /** The tenant's budget against the provider's ledger and the service's record (see the module's header). */
  async function reconcile(report: TenantReport, how: NonNullable<BudgetDeps["reconcile"]>): Promise<Reconciled> {
    const unit = report.unit;
    // The provider's side: every request of the tenant's jobs, what it billed and what its call reserved.
    const calls = new Map<
      number,
      { job: number; kind: RequestKind | undefined; billed?: number; billedTokens?: number; worst: number }
    >();
    deps.model.bodies.forEach((raw, i) => {
      const body = raw as ChatBody;
      const job = deps.jobOf(body);
      if (job === undefined || deps.jobs[job]?.tenant !== report.tenant) return;
      const usage = deps.model.usages[i];
      const w = worstOf(body);
      calls.set(i + 1, {
        job,
        kind: how.kindOf(i + 1),
        billed: usage ? amount(unit, body, usage.prompt_tokens, usage.completion_tokens) : undefined,
        billedTokens: usage ? usage.prompt_tokens + usage.completion_tokens : undefined,
        worst: amount(unit, body, w.prompt, w.completion),
      });
    });
    // The service's side: every attempt it recorded, with its charge (`charged_tokens` where the column exists).
    const rows = await deps.sql<
      {
        job_id: string;
        request: string | null;
        tokens: number | null;
        status: number | null;
        cost: string | null;
        charged: number | null;
      }[]
    >`
      SELECT job_id::text, provider_request_id AS request, (prompt_tokens + completion_tokens)::int AS tokens, status,
        cost_usd::text AS cost, (to_jsonb(m)->>'charged_tokens')::bigint AS charged
      FROM model_attempts m WHERE tenant = ${report.tenant}`;
    const accounted = new Set<number>();
    const out: Reconciled = {
      settled: { reported: 0, reservation: 0, nothing: 0 },
      expected: 0,
      billed: 0,
      cutOff: { ok: 0, hang: 0, status: 0 },
      cutOffSpentAtMost: 0,
      cutOffHeldAtMost: 0,
      unmatched: 0,
      disagreeing: 0,
    };
    const statusRows = new Map<number, number>();
    const reservationRows: { job: number | undefined; nanos: number; charged: number | null }[] = [];
    for (const row of rows) {
      const n = /^req_(\d+)$/.exec(row.request ?? "")?.[1];
      const call = n === undefined ? undefined : calls.get(Number(n));
      if (row.tokens !== null && call) {
        // Charged the provider's usage: counted at the provider's own count for that request.
        out.settled.reported++;
        out.expected += call.billed ?? 0;
        if (call.billedTokens !== row.tokens) out.disagreeing++;
        accounted.add(Number(n));
        continue;
      }
      const nanos = usdNanos(row.cost);
      const job = how.jobIndexOf(row.job_id);
      if (row.tokens === null && nanos > 0) reservationRows.push({ job, nanos, charged: row.charged });
      else {
        out.settled.nothing++;
        if (row.status !== null && job !== undefined) statusRows.set(job, (statusRows.get(job) ?? 0) + 1);
      }
    }
    // A row charged its reservation: matched to a request of its job whose worst case costs the same, one the
    // provider left hanging first (a timeout), else one it answered too late.
    for (const row of reservationRows) {
      const match = [...calls].filter(([n, c]) =>
        !accounted.has(n) && c.job === row.job && c.kind !== "status" && nanosOfWorst(n) === row.nanos
      ).sort(([, a], [, b]) =>
        (a.kind === "hang" ? 0 : 1) - (b.kind === "hang" ? 0 : 1)
      )[0];
      out.settled.reservation++;
      if (!match) {
        out.unmatched++;
        out.expected += unit === "usd" ? row.nanos : row.charged ?? 0;
        continue;
      }
      accounted.add(match[0]);
      out.expected += match[1].worst;
    }
    // What is left was cut off by a kill: settled (and then its worker died before the record), or still held.
    const statusLeft = new Map<number, number>();
    for (const [n, c] of calls) {
      out.billed += c.billed ?? 0;
      if (accounted.has(n)) continue;
      if (c.kind === "status") {
        // Refused calls name no request id: counted per job, those beyond the job's refused rows were cut off.
        const left = (statusLeft.get(c.job) ?? statusRows.get(c.job) ?? 0) - 1;
        statusLeft.set(c.job, left);
        if (left >= 0) continue;
        out.cutOff.status++;
      } else if (c.kind === "hang") {
        out.cutOff.hang++;
        out.cutOffSpentAtMost += c.worst;
      } else {
        out.cutOff.ok++;
        out.cutOffSpentAtMost += c.billed ?? c.worst;
      }
      out.cutOffHeldAtMost += c.worst;
    }
    return out;

    /** What request n's worst case costs in nano-USD (how a reservation charge is recorded in `cost_usd`). */
    function nanosOfWorst(n: number): number {
      const body = deps.model.bodies[n - 1] as ChatBody;
      const w = worstOf(body);
      return nanosOf(body, w.prompt, w.completion);
    }
  }

  function reconciledRows(r: TenantReport, x: Reconciled): [string, string][] {
    const t = r.tenant;
    const spent = r.atEnd?.spent ?? NaN, reserved = r.atEnd?.reserved ?? NaN;
    const off = x.expected === 0 ? 0 : (100 * (spent - x.expected)) / x.expected;
    return [
      [
        `${t}: calls settled, charged the provider's count / their reservation / nothing`,
        `${x.settled.reported} / ${x.settled.reservation} / ${x.settled.nothing}`,
      ],
      [
        `${t}: the budget's spend at the end / what the settled calls cost (provider's count + reservations)`,
        `${show(r.unit, spent)} / ${show(r.unit, x.expected)} (${off >= 0 ? "+" : ""}${off.toFixed(1)}%)`,
      ],
      [
        `${t}: calls cut off by a kill (no record): answered / hanging / refused; may have spent / may hold`,
        `${x.cutOff.ok} / ${x.cutOff.hang} / ${x.cutOff.status}; ${show(r.unit, x.cutOffSpentAtMost)} / ${
          show(r.unit, x.cutOffHeldAtMost)
        }`,
      ],
      [`${t}: still reserved at the end, no call in flight`, show(r.unit, reserved)],
    ];
  }

  /** What the reconciliation found wrong for one tenant. */
  function reconcileProblems(r: TenantReport): string[] {
    const x = r.reconciled, end = r.atEnd;
    if (!x || !end) return [`${r.tenant}: the budget could not be reconciled at the end`];
    const problems: string[] = [];
    const slack = SPEND_TOLERANCE * x.expected;
    // Spent: every settled call once, at its charge; a cut-off call may have been settled too (its record lost).
    if (end.spent < x.expected - slack || end.spent > x.expected + x.cutOffSpentAtMost + slack) {
      problems.push(
        `${r.tenant}: the budget recorded ${show(r.unit, end.spent)} spent where the settled calls cost ` +
          `${show(r.unit, x.expected)} by the provider's count and their reservations` +
          (x.cutOffSpentAtMost > 0 ? ` (plus at most ${show(r.unit, x.cutOffSpentAtMost)} for calls cut off)` : ""),
      );
    }
    // Reserved: only what a call cut off by a kill may still hold.
    if (end.reserved > x.cutOffHeldAtMost) {
      problems.push(
        `${r.tenant}: ${show(r.unit, end.reserved)} left reserved with no call in flight, where the calls cut off ` +
          `by kills may hold ${show(r.unit, x.cutOffHeldAtMost)}`,
      );
    }
    // Together: each cut-off call is either settled or held, never both, never neither.
    if (end.spent + end.reserved < x.expected - slack) {
      problems.push(`${r.tenant}: spent + reserved is less than what the settled calls cost`);
    }
    if (end.spent + end.reserved > x.expected + x.cutOffHeldAtMost + slack) {
      problems.push(
        `${r.tenant}: spent + reserved (${show(r.unit, end.spent + end.reserved)}) is more than the settled calls ` +
          `cost and the calls cut off may hold (${show(r.unit, x.expected + x.cutOffHeldAtMost)})`,
      );
    }
    if (x.unmatched > 0) problems.push(`${r.tenant}: ${x.unmatched} reservation charge(s) match no provider request`);
    if (x.disagreeing > 0) {
      problems.push(`${r.tenant}: ${x.disagreeing} recorded usage(s) differ from the provider's count`);
    }
    return problems;
  }
}

/** A `numeric` of USD (`0.000001234`) as whole nano-dollars, exactly; 0 for none. */
function usdNanos(usd: string | null): number {
  if (!usd) return 0;
  const [whole = "0", fraction = ""] = usd.split(".");
  return Number(whole) * 1e9 + Number(fraction.padEnd(9, "0").slice(0, 9));
}
