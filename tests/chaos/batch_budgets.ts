/**
 * `deno task chaos:batches --budgets`: two of the batch chaos run's tenants on a budget, set with the real `tenant
 * budget` command before the processes start: `batch-a` in tokens and USD per UTC day, `batch-b` in tokens and USD
 * per UTC month. Each is worth {@linkcode RUN_WORST_BOUND} tokens for each of the tenant's runs and a few more (USD:
 * those tokens at the dearest price, $8 per Mtok), so every run fits: this mode proves the accounting under kills,
 * not refusal (a run whose hold did not fit would run online, which the run's own checks catch as a run never
 * recorded into a batch).
 *
 * While the run goes on, each budget is read every 250 ms (`readBudgetState`): its spend plus what is held and
 * reserved must never pass a limit. At the end, once everything is drained, each budgeted tenant's hash is read
 * whole (`HGETALL`) and checked against Postgres and the fake provider:
 *
 * 1. **No hold is left**: no `B:` field, `bh:tok` and `bh:usd` 0 or absent. A hold goes when its line settles (the
 *    poller's `chargeLine` / `releaseHold`); the sweep (every 5 minutes) takes only holds older than 10 minutes,
 *    which a run of a few minutes never has, so this checks the settlements alone. Two kinds of hold are left to
 *    the sweep by design, and neither can arise here: a hold with no line behind it (a worker killed between the
 *    hold and the recording, and the run cancelled before its redelivery) and a `left_out` line's (a run decided
 *    before its upload). This harness cancels no run, so every run is recorded (a redelivery finds its hold, or
 *    its run recorded) and every line goes into its file; a hold left is a failure. Each is named with what
 *    Postgres says of its run (its line, settled or not; its outcome; its usage rows), so a failure shows which
 *    window leaked it.
 * 2. **Spend is the record**: the spend fields (`d<day>:tok|usd`, `m<month>:tok|usd`, summed over the days and
 *    months present) equal the sum of the tenant's `model_attempts` rows' `charged_tokens` and `cost_usd` (in
 *    nano-USD, at most 1 nano of rounding per row), and its batch rows (`batch_id` set) equal the usage the fake
 *    provider reported for the tenant's batch lines at the batch prices. A row without `batch_id` must be a call of
 *    a run that went online (an unfinished line, a repair). The one gap allowed is the online path's own (as in
 *    `deno task chaos --budgets --redis-drops`): an online call a kill cut off, known by a provider request no row
 *    names, was either settled before its worker died (its row, written after the settlement, lost: spend holds
 *    its usage) or not (its reservation, `R:<id>`, still held: charged whole after 30 minutes by design). Each such
 *    call must be one or the other, never both or neither: the harness looks for the split that makes spend exact,
 *    and every reservation left must be one of the tenant's online calls' worst case. Every line of the tenant
 *    must have been held (`batch_runs.held_tokens`).
 * 3. **Never exceeded**: no sample saw spend plus holds and reservations over a limit, the spend at the end is
 *    within each limit, and so is everything the provider billed the tenant for.
 *
 * `--corrupt-budget` (a self-check of these checks; implies `--budgets`): once the run has drained, a stray hold
 * and a day's spend over the limit are written into `batch-a`'s hash. The run then passes only if each of the three
 * checks failed for it, and nothing else did.
 */
import type { Sql } from "postgres";
import type { Redis } from "ioredis";
import { type BudgetKeys, worstCaseTokens } from "../../src/budgets/budgets.ts";
import type { CallTokens } from "../../src/budgets/charge.ts";
import { readBudgetState } from "../../src/budgets/read_script.ts";
import { MAX_OUTPUT_TOKENS } from "../../src/llm/llm.ts";
import { costNanos, type ModelPrice, usdToNanos } from "../../src/llm/prices.ts";
import type { ChatBody, Usage } from "../support/fake_model_server.ts";

/** The budgeted tenants and the period of each one's budgets (tokens and USD). */
export const BUDGETED = { "batch-a": "day", "batch-b": "month" } as const;
type Budgeted = keyof typeof BUDGETED;

/**
 * Tokens that bound any run's worst case here (its messages and schema, well under 2 KiB, plus 1,024 output
 * tokens): a budget is worth this many per run of its tenant, plus {@linkcode SPARE_RUNS}.
 */
export const RUN_WORST_BOUND = 4_096;
const SPARE_RUNS = 8;
/** The dearest price per token of the run ($8 per Mtok, online output), in USD: a USD budget's worth. */
const DEAREST_USD_PER_TOKEN = 8e-6;

/** Which check a problem is of (`--corrupt-budget` expects each). */
export type BudgetCheck = "holds" | "spend" | "limit" | "other";

/** One online model request, as the fake provider saw it. */
export interface OnlineRequest {
  /** The request's number (its `x-request-id` is `req_<n>`). */
  n: number;
  /** The run it named, and that run's number in the harness (`of job N.`). */
  runId: string | undefined;
  job: number;
  body: ChatBody;
  usage: Usage | undefined;
}

/** What the end checks read from the run. */
export interface BudgetEnd {
  /** The run ids of a tenant's accepted runs. */
  runsOf(tenant: string): string[];
  /** The usage the provider reported for each answered batch line, by run id. */
  reported: ReadonlyMap<string, Usage>;
  /** Every online model request. */
  online: readonly OnlineRequest[];
  /** Whether a run went online (an unfinished line, or a structured answer repaired). */
  wentOnline(runId: string): boolean;
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

/** A `numeric` of USD (`0.000001234`) as whole nano-dollars, exactly; 0 for none. */
function usdNanos(usd: string | null): number {
  if (!usd) return 0;
  const [whole = "0", fraction = ""] = usd.split(".");
  return Number(whole) * 1e9 + Number(fraction.padEnd(9, "0").slice(0, 9));
}

const tokens = (n: number) => n.toLocaleString("en-US");
const dollars = (nanos: number) => `$${(nanos / 1e9).toFixed(6)}`;

/** The budgets mode of the batch chaos run. */
export function batchBudgets(deps: {
  sql: Sql;
  redis: Redis;
  keys: BudgetKeys;
  price: ModelPrice;
  /** Runs `main.ts tenant ARGS` as `deno task tenant` would; @returns its output. */
  tenantCommand(args: string[]): Promise<string>;
  /** How many runs a tenant will post. */
  plannedRuns(tenant: string): number;
}) {
  const tenants = Object.keys(BUDGETED) as Budgeted[];
  /** Each tenant's limits: tokens, and nano-USD. */
  const limits = new Map<Budgeted, { tokens: number; nanos: number }>();
  /** What the samples saw, per tenant. */
  const peaks = new Map<Budgeted, { samples: number; ratio: number; held: number; over: string[] }>();
  const checks: { check: BudgetCheck; problem: string }[] = [];
  const rows: [string, string][] = [];
  const problem = (check: BudgetCheck, text: string) => checks.push({ check, problem: text });
  /** The budgets' indices (tokens, nano-USD) of a tenant's period, in the scripts' order. */
  const indices = (t: Budgeted) => (BUDGETED[t] === "day" ? [0, 1] as const : [2, 3] as const);

  return {
    tenants,

    /** Sets the budgets with the real `tenant budget` command (before the processes start). */
    async setUp() {
      await Promise.all(tenants.map(async (t) => {
        const tok = (deps.plannedRuns(t) + SPARE_RUNS) * RUN_WORST_BOUND;
        const usd = (tok * DEAREST_USD_PER_TOKEN).toFixed(6);
        const period = BUDGETED[t];
        await deps.tenantCommand(["budget", t, `--tokens-per-${period}`, String(tok), `--usd-per-${period}`, usd]);
        limits.set(t, { tokens: tok, nanos: usdToNanos(Number(usd)) });
        peaks.set(t, { samples: 0, ratio: 0, held: 0, over: [] });
      }));
    },

    /** One sample of each budget: spend plus holds and reservations against its limits (every 250 ms or so). */
    async sample() {
      for (const t of tenants) {
        const s = await readBudgetState(deps.redis, deps.keys.budget(t));
        const [ti, ui] = indices(t);
        const limit = limits.get(t)!, peak = peaks.get(t)!;
        const held = await deps.redis.hget(deps.keys.budget(t), "bh:tok");
        peak.samples++;
        peak.held = Math.max(peak.held, Number(held ?? 0));
        for (const [i, max] of [[ti, limit.tokens], [ui, limit.nanos]] as const) {
          const used = s.spent[i] + s.reserved[i];
          peak.ratio = Math.max(peak.ratio, used / max);
          if (used > max && peak.over.length < 5) {
            peak.over.push(
              `${i % 2 === 0 ? "tokens" : "nano-USD"} ${s.spent[i]} spent + ${s.reserved[i]} held > ${max}`,
            );
          }
        }
      }
    },

    /** `--corrupt-budget`: a stray hold and a day's spend over the limit in the first tenant's hash. */
    async corrupt() {
      const t = tenants[0]!, key = deps.keys.budget(t);
      const { day } = await readBudgetState(deps.redis, key);
      await deps.redis.multi()
        .hset(key, `B:${crypto.randomUUID()}`, `${Date.now()},1000,1000`)
        .hincrby(key, "bh:tok", 1000)
        .hincrby(key, "bh:usd", 1000)
        .hincrby(key, `d${day}:tok`, limits.get(t)!.tokens + 1)
        .exec();
    },

    /** The end checks (see the module's header). */
    async finish(end: BudgetEnd) {
      for (const t of tenants) await finishTenant(t, end);
    },

    rows: () => rows,
    problems: () => checks,
  };

  async function finishTenant(t: Budgeted, end: BudgetEnd) {
    const key = deps.keys.budget(t), limit = limits.get(t)!, peak = peaks.get(t)!;
    const hash = await deps.redis.hgetall(key);
    const fields = Object.entries(hash);
    const sum = (re: RegExp) => fields.filter(([f]) => re.test(f)).reduce((a, [, v]) => a + Number(v), 0);
    const spent = {
      dayTok: sum(/^d\d+:tok$/),
      dayUsd: sum(/^d\d+:usd$/),
      monthTok: sum(/^m\d+:tok$/),
      monthUsd: sum(/^m\d+:usd$/),
    };
    const state = await readBudgetState(deps.redis, key);
    const [ti, ui] = indices(t);

    // 1. No hold left.
    const holds = fields.filter(([f]) => f.startsWith("B:")).map(([f, v]) => ({ id: f.slice(2), value: v }));
    const bh = { tok: Number(hash["bh:tok"] ?? 0), usd: Number(hash["bh:usd"] ?? 0) };
    if (holds.length > 0 || bh.tok !== 0 || bh.usd !== 0) {
      const described = await describeHolds(holds.map((h) => h.id));
      problem(
        "holds",
        `${t}: ${holds.length} hold(s) left (bh:tok ${bh.tok}, bh:usd ${bh.usd}) once everything settled: ` +
          holds.slice(0, 5).map((h) => `${h.id} (${h.value}: ${described.get(h.id) ?? "?"})`).join("; "),
      );
    }
    const lines = await deps.sql<{ lines: number; held: number; sum: string | null; max: number | null }[]>`
      SELECT count(*)::int AS lines, count(held_tokens)::int AS held, sum(held_tokens)::text AS sum,
        max(held_tokens)::int AS max
      FROM batch_runs WHERE tenant = ${t}`;
    const line = lines[0]!;
    if (line.held !== line.lines) problem("other", `${t}: ${line.lines - line.held} line(s) collected with no hold`);

    // 2. Spend is the record: model_attempts, the provider's report at batch prices, and the online calls cut off.
    const attempts = await deps.sql<
      { job_id: string; batch_id: string | null; request: string | null; charged: string | null; usd: string | null }[]
    >`
      SELECT job_id::text, batch_id::text, provider_request_id AS request, charged_tokens::text AS charged,
        cost_usd::text AS usd
      FROM model_attempts WHERE tenant = ${t}`;
    const rowTok = (r: typeof attempts[number]) => Number(r.charged ?? 0);
    const batchRows = attempts.filter((r) => r.batch_id !== null);
    const onlineRows = attempts.filter((r) => r.batch_id === null);
    const rowsTok = attempts.reduce((a, r) => a + rowTok(r), 0);
    const rowsNanos = attempts.reduce((a, r) => a + usdNanos(r.usd), 0);
    const batchTok = batchRows.reduce((a, r) => a + rowTok(r), 0);
    const batchNanos = batchRows.reduce((a, r) => a + usdNanos(r.usd), 0);
    const strayOnline = onlineRows.filter((r) => !end.wentOnline(r.job_id)).length;
    if (strayOnline > 0) problem("spend", `${t}: ${strayOnline} usage row(s) without batch_id of runs never online`);

    const mine = new Set(end.runsOf(t));
    let reportedTok = 0, reportedNanos = 0, reportedLines = 0;
    for (const [id, u] of end.reported) {
      if (!mine.has(id)) continue;
      reportedLines++;
      reportedTok += u.prompt_tokens + u.completion_tokens;
      reportedNanos += costNanos(deps.price, u.prompt_tokens, u.completion_tokens, true);
    }
    if (batchTok !== reportedTok || Math.abs(batchNanos - reportedNanos) > batchRows.length) {
      problem(
        "spend",
        `${t}: batch usage rows ${tokens(batchTok)} tokens / ${dollars(batchNanos)} where the provider reported ` +
          `${tokens(reportedTok)} tokens for the tenant's ${reportedLines} answered lines (${
            dollars(reportedNanos)
          } at batch prices)`,
      );
    }

    // The tenant's online calls: those no row names were cut off by a kill (settled or still reserved).
    const online = end.online.filter((r) => r.runId !== undefined && mine.has(r.runId));
    const named = new Set(attempts.map((r) => r.request));
    const cutOff = online.filter((r) => r.usage !== undefined && !named.has(`req_${r.n}`));
    const reservations = fields.filter(([f]) => f.startsWith("R:")).map(([, v]) => Number(v.split(",")[1]));
    const chargedWhole = fields.filter(([f]) => f.startsWith("X:")).length;
    if (chargedWhole > 0) {
      problem("spend", `${t}: ${chargedWhole} reservation(s) charged whole (X:) within a run of minutes`);
    }
    const worstTokens = (r: OnlineRequest) => {
      const w = worstOf(r.body);
      return w.prompt + w.completion;
    };
    const onlineWorsts = new Set(online.map(worstTokens));
    const split = settledSplit(cutOff, reservations, worstTokens, (settled) => {
      const tok = rowsTok + settled.reduce((a, r) => a + r.usage!.prompt_tokens + r.usage!.completion_tokens, 0);
      const nanos = rowsNanos +
        settled.reduce((a, r) => a + costNanos(deps.price, r.usage!.prompt_tokens, r.usage!.completion_tokens), 0);
      const slack = attempts.length + settled.length;
      return spent.dayTok === tok && spent.monthTok === tok && Math.abs(spent.dayUsd - nanos) <= slack &&
        Math.abs(spent.monthUsd - nanos) <= slack;
    });
    if (!split) {
      problem(
        "spend",
        `${t}: spent ${tokens(spent.dayTok)} tokens / ${dollars(spent.dayUsd)} by day (${tokens(spent.monthTok)} / ${
          dollars(spent.monthUsd)
        } by month), where its ${attempts.length} model_attempts rows charged ` +
          `${tokens(rowsTok)} / ${dollars(rowsNanos)}` +
          (cutOff.length > 0 ? ` and ${cutOff.length} online call(s) a kill cut off may account for the rest` : ""),
      );
    }
    const unexplained = split ? split.leftover.filter((tok) => !onlineWorsts.has(tok)).length : 0;
    if (unexplained > 0) {
      problem("spend", `${t}: ${unexplained} reservation(s) left that are no online call's worst case`);
    }

    // 3. Never exceeded: in any sample, at the end, and by what the provider billed.
    if (peak.over.length > 0) problem("limit", `${t}: a sample saw a budget passed: ${peak.over.join("; ")}`);
    const endTok = state.spent[ti], endNanos = state.spent[ui];
    if (endTok > limit.tokens || endNanos > limit.nanos) {
      problem(
        "limit",
        `${t}: spent ${tokens(endTok)} tokens / ${dollars(endNanos)} this ${BUDGETED[t]}, over its budget of ` +
          `${tokens(limit.tokens)} / ${dollars(limit.nanos)}`,
      );
    }
    let billedTok = reportedTok, billedNanos = reportedNanos;
    for (const r of online) {
      if (!r.usage) continue;
      billedTok += r.usage.prompt_tokens + r.usage.completion_tokens;
      billedNanos += costNanos(deps.price, r.usage.prompt_tokens, r.usage.completion_tokens);
    }
    if (billedTok > limit.tokens || billedNanos > limit.nanos) {
      problem("limit", `${t}: the provider billed ${tokens(billedTok)} tokens / ${dollars(billedNanos)}, over budget`);
    }

    const view = await deps.tenantCommand(["budget", t]).catch((error) => `(${error})`);
    const linesAnswered = Math.max(1, reportedLines);
    rows.push(
      [
        `${t}: budget per ${BUDGETED[t]} (tokens / USD)`,
        `${tokens(limit.tokens)} / ${dollars(limit.nanos)} (${RUN_WORST_BOUND} tokens a run)`,
      ],
      [
        `${t}: lines held / lines; held a line, mean / max; charged a line, mean`,
        `${line.held} / ${line.lines}; ${tokens(Math.round(Number(line.sum ?? 0) / Math.max(1, line.held)))} / ${
          tokens(line.max ?? 0)
        }; ${tokens(Math.round(reportedTok / linesAnswered))}`,
      ],
      [
        `${t}: peak spent + held + reserved, of the limit (samples); peak held`,
        `${(100 * peak.ratio).toFixed(1)}% (${peak.samples}); ${tokens(peak.held)} tokens`,
      ],
      [`${t}: holds left (B: fields) / bh:tok / bh:usd`, `${holds.length} / ${bh.tok} / ${bh.usd}`],
      [
        `${t}: spent tokens, by day / by month / model_attempts rows (batch + online)`,
        `${tokens(spent.dayTok)} / ${tokens(spent.monthTok)} / ${tokens(rowsTok)} (${tokens(batchTok)} + ${
          tokens(rowsTok - batchTok)
        })`,
      ],
      [
        `${t}: spent USD, by day / by month / model_attempts rows (batch + online)`,
        `${dollars(spent.dayUsd)} / ${dollars(spent.monthUsd)} / ${dollars(rowsNanos)} (${dollars(batchNanos)} + ${
          dollars(rowsNanos - batchNanos)
        })`,
      ],
      [
        `${t}: provider's report for its ${reportedLines} batch lines, at batch prices`,
        `${tokens(reportedTok)} tokens / ${dollars(reportedNanos)}`,
      ],
      [
        `${t}: online calls / cut off by a kill (settled, row lost / still reserved) / reservations left`,
        `${online.length} / ${cutOff.length} (${split ? split.settled : "?"} / ${
          split ? cutOff.length - split.settled : "?"
        }) / ${reservations.length}`,
      ],
      [`${t}: \`tenant budget ${t}\` at the end`, view.trim().replace(/\|/g, "\\|")],
    );
    if (cutOff.length > 0 || reservations.length > 0) {
      const shown = cutOff.map((r) =>
        `req_${r.n} (job ${r.job}, ${split ? (split.settledSet.has(r) ? "settled" : "reserved") : "?"}, worst ${
          worstTokens(r)
        })`
      );
      rows.push([
        `${t}: online calls cut off; reservations left (tokens), with the jobs whose online call's worst case it is`,
        `${shown.join(", ") || "-"}; ${
          reservations.map((tok) =>
            `${tok} (job ${online.filter((r) => worstTokens(r) === tok).map((r) => r.job).join("/") || "none"})`
          ).join(", ") || "-"
        }`,
      ]);
    }
  }

  /** What Postgres says of the runs whose holds were left: their line, outcome and usage rows. */
  async function describeHolds(ids: string[]): Promise<Map<string, string>> {
    if (ids.length === 0) return new Map();
    const found = await deps.sql<
      { id: string; batch: string | null; settled: string | null; outcome: string | null; rows: number }[]
    >`
      SELECT i.id::text AS id, r.batch_id::text AS batch, r.settled, o.outcome,
        (SELECT count(*) FROM model_attempts a WHERE a.job_id = i.id)::int AS rows
      FROM unnest(${ids}::uuid[]) AS i(id)
      LEFT JOIN batch_runs r ON r.run_id = i.id LEFT JOIN job_outcomes o ON o.job_id = i.id`;
    return new Map(found.map((f) => [
      f.id,
      f.batch === null
        ? `no line; outcome ${f.outcome ?? "none"}`
        : `line in batch ${f.batch} settled ${f.settled ?? "no"}; outcome ${
          f.outcome ?? "none"
        }; ${f.rows} usage row(s)`,
    ]));
  }
}

/**
 * Which of the online calls a kill cut off were settled before their worker died (the rest still reserved): the
 * split that `exact` accepts (the spend it implies is the spend found), with each call not settled matched to a
 * reservation left of its worst case. @returns how many were settled and the reservations no cut-off call
 * accounts for (a kill between a reservation and its request), or undefined when no split works.
 */
function settledSplit(
  cutOff: OnlineRequest[],
  reservations: number[],
  worst: (r: OnlineRequest) => number,
  exact: (settled: OnlineRequest[]) => boolean,
): { settled: number; settledSet: Set<OnlineRequest>; leftover: number[] } | undefined {
  // A handful at most (none in most runs): every split is tried.
  if (cutOff.length > 16) return undefined;
  for (let mask = 0; mask < 1 << cutOff.length; mask++) {
    const settled = cutOff.filter((_, i) => (mask >> i) & 1);
    if (!exact(settled)) continue;
    const leftover = [...reservations];
    const held = cutOff.filter((_, i) => !((mask >> i) & 1)).every((r) => {
      const at = leftover.indexOf(worst(r));
      if (at < 0) return false;
      leftover.splice(at, 1);
      return true;
    });
    if (held) return { settled: settled.length, settledSet: new Set(settled), leftover };
  }
  return undefined;
}
