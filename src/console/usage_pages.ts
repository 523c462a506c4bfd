/**
 * The console's pictures: the usage page (`/console/usage`, per tenant or
 * all tenants, over a window of 1 hour per minute, 24 hours per hour or 7
 * days per 6 hours: calls and 429s, tokens and spend against the daily
 * budget, cache hits), the same figures of one task for its page, and the
 * queues page's charts (throughput and latency per minute over the last
 * hour, or per hour over 24 hours). The figures come from the same rows,
 * with the same definitions, as `GET /v1/usage` (`src/jobs/usage_series.ts`);
 * 429s from the API's per-minute record (`src/metrics/refusals.ts`).
 */
import type { Queryable } from "../db/queryable.ts";
import {
  cacheHitsPerBucket,
  outcomesPerBucket,
  spentSince,
  usagePerBucket,
  usageTenants,
  type Window,
} from "../jobs/usage_series.ts";
import { tenantBudgets } from "../tenants/tenant_budgets.ts";
import { refusalsKeptFrom, refusalsPerMinute } from "../metrics/refusals.ts";
import { clockWindow, unknownWindow, type UsageWindow, usageWindow, windowSwitch } from "./chart_windows.ts";
import { type Bucket, bucketRange, chart, type ChartSeries, formatCount, formatMs, formatUsd } from "./charts.ts";
import { type Html, html, raw } from "./html.ts";
import { page, PAGE_ROWS, table, type View } from "./layout.ts";
import type { PageDeps } from "./_deps.ts";

const MINUTE_MS = 60_000, HOUR_MS = 3_600_000, DAY_MS = 86_400_000;

/** The colours of the series. */
const COLORS = {
  calls: "#3b6fb6",
  refused: "#e08a1e",
  prompt: "#3b6fb6",
  completion: "#8fb3e3",
  today: "#1b2a41",
  spend: "#2e8b57",
  hits: "#7a52b3",
  done: "#2e8b57",
  failed: "#c0392b",
  cancelled: "#9aa3ad",
  expired: "#c9a227",
  p50: "#3b6fb6",
  p99: "#e08a1e",
};

/** Figures from Postgres's numeric text; 0 for none. */
const usd = (text: string | null | undefined) => (text ? Number(text) : 0);

/** Zeros, one per bucket. */
const zeros = (w: Window) => Array.from({ length: w.count }, () => 0);

/** Days since the epoch (UTC) of `ms`. */
const dayOf = (ms: number) => Math.floor(ms / DAY_MS);

/** `2026-12-01 14:05` (UTC). */
const minuteOf = (ms: number) => new Date(ms).toISOString().slice(0, 16).replace("T", " ");

/**
 * The 429s of `tenants` per bucket of `window`, summed; null for a bucket that starts before the oldest hour
 * still kept at `nowMs` (a part of its 429s would pass for all of them).
 */
async function refusalsPerBucket(
  deps: PageDeps,
  tenants: string[],
  window: Window,
  nowMs: number,
): Promise<(number | null)[]> {
  const kept = Math.max(0, Math.ceil((refusalsKeptFrom(nowMs) - window.fromMs) / window.widthMs));
  const out = Array.from({ length: window.count }, (_, i) => (i < kept ? null : 0));
  const fromMs = window.fromMs + kept * window.widthMs, toMs = window.fromMs + window.count * window.widthMs;
  const each = await Promise.all(
    tenants.map((t) => refusalsPerMinute(deps.redis, deps.keys, t, { fromMs, toMs })),
  );
  for (const minutes of each) {
    for (const [minute, n] of minutes) out[Math.floor((minute * MINUTE_MS - window.fromMs) / window.widthMs)]! += n;
  }
  return out;
}

/** A `<dl>` of figures, each `<dd>` with an id (`total-calls`). */
function figures(items: [id: string, label: string, value: string][]): Html {
  return html`<dl class="figures">${
    items.map(([id, label, value]) =>
      html`
        <dt>${label}</dt>
        <dd id="${id}">${value}</dd>
      `
    )
  }</dl>`;
}

/** The tenant selector: a GET form, no script; it keeps the window. */
function tenantSelector(tenants: string[], selected: string | undefined, win: UsageWindow): Html {
  const options = tenants.map((t) =>
    html`
      <option value="${t}" ${t === selected ? raw(" selected") : ""}>${t}</option>
    `
  );
  return html`<form method="get" action="/console/usage" class="selector"><label>Tenant <select name="tenant">
    <option value=""${selected === undefined ? raw(" selected") : ""}>All tenants</option>${options}</select></label>
    <input type="hidden" name="window" value="${win.name}"><button>Show</button></form>`;
}

/** Model calls, tokens, cost and cache hits per bucket of a window, as the usage charts draw them. */
export interface UsageFigures {
  calls: number[];
  prompt: number[];
  completion: number[];
  cost: number[];
  /** Calls in the window with no price: their cost counts nothing. */
  unpriced: number;
  hits: number[];
  savedTokens: number[];
  savedUsd: number[];
  /** With `dayToDate`: the day so far (UTC) at each bucket's end, and where a new day starts it afresh. */
  today?: { tokens: number[]; spend: number[]; restarts: boolean[] };
}

/**
 * The usage of `tenant` (all tenants when unset), or of its task `task` alone, per bucket of `window`; with
 * `dayToDate`, also the day's running totals since 00:00 UTC, for which the calls since midnight of the window's
 * first day are read.
 */
export async function usageFigures(
  sql: Queryable,
  { tenant, task, window, buckets, dayToDate = false }: {
    tenant?: string;
    task?: string;
    window: Window;
    buckets: Bucket[];
    dayToDate?: boolean;
  },
): Promise<UsageFigures> {
  const sinceMs = dayToDate ? dayOf(window.fromMs) * DAY_MS : window.fromMs;
  const [usage, hits] = await Promise.all([
    usagePerBucket(sql, { tenant, task, window, sinceMs }),
    cacheHitsPerBucket(sql, { tenant, task, window }),
  ]);
  const f: UsageFigures = {
    calls: zeros(window),
    prompt: zeros(window),
    completion: zeros(window),
    cost: zeros(window),
    unpriced: 0,
    hits: zeros(window),
    savedTokens: zeros(window),
    savedUsd: zeros(window),
  };
  for (const r of usage) {
    if (r.bucket < 0) continue;
    f.calls[r.bucket]! += r.calls;
    f.prompt[r.bucket]! += r.prompt_tokens;
    f.completion[r.bucket]! += r.completion_tokens;
    f.cost[r.bucket]! += usd(r.cost_usd);
    f.unpriced += r.unpriced;
  }
  for (const h of hits) {
    f.hits[h.bucket]! += h.hits;
    f.savedTokens[h.bucket]! += h.saved_tokens;
    f.savedUsd[h.bucket]! += usd(h.saved_usd);
  }
  if (!dayToDate) return f;
  // The day's running total at each bucket's end: the calls of the day that bucket ends in, up to its end.
  const runningTotal = (of: (r: (typeof usage)[number]) => number) =>
    buckets.map((b, i) => {
      const day = dayOf(b.endMs - 1);
      return usage.filter((r) => r.day === day && r.bucket <= i).reduce((sum, r) => sum + of(r), 0);
    });
  f.today = {
    tokens: runningTotal((r) => r.prompt_tokens + r.completion_tokens),
    spend: runningTotal((r) => usd(r.cost_usd)),
    // The running totals start afresh at the first bucket of a new day.
    restarts: buckets.map((b, i) => i > 0 && dayOf(b.endMs - 1) !== dayOf(buckets[i - 1]!.endMs - 1)),
  };
  return f;
}

const sum = (xs: readonly (number | null)[]) => xs.reduce((a: number, b) => a + (b ?? 0), 0);

/**
 * The usage charts of `f` over `win`: model calls (and, on the usage page, the 429s, which are counted per
 * tenant), tokens and spend (with `f.today`, the day's running total; with `budgets`, the daily budgets as
 * lines), and cache hits, each titled and labelled per `win`'s bucket.
 */
export function usageCharts(
  f: UsageFigures,
  { who, win, buckets, refused, budgets }: {
    /** Whose figures, in a sentence: `tenant acme`. */
    who: string;
    win: UsageWindow;
    buckets: Bucket[];
    refused?: (number | null)[];
    /** The daily budgets (null: none), and what a description says where there is none. */
    budgets?: { tokens: number | null; usd: number | null; none: string };
  },
): Html[] {
  const { unit, span, xLabel, labelEvery } = win;
  const per = `per ${unit}`;
  const { today } = f;
  const dayLine = (key: string, of: (t: NonNullable<typeof today>) => number[]): ChartSeries[] =>
    today
      ? [{
        key,
        name: "day so far",
        kind: "line",
        values: of(today),
        color: COLORS.today,
        at: "end",
        restarts: today.restarts,
      }]
      : [];
  const refusedBars: ChartSeries[] = refused
    ? [{ key: "refused", name: "429s", kind: "bar", values: refused, color: COLORS.refused }]
    : [];
  const lineAxis = today ? `${xLabel} (bars: ${per}; line: the day so far, since 00:00 UTC)` : xLabel;
  const running = today ? ", and the day's running total (since 00:00 UTC)" : "";
  const against = (limit: number | null | undefined, what: string) =>
    budgets ? ` against the daily ${what} budget.${limit === null ? budgets.none : ""}` : ".";
  const limitAt = (value: number | null | undefined) =>
    value === null || value === undefined ? undefined : { value, label: "budget per day" };
  const forgotten = refused?.includes(null) ? " 429s are kept 25 hours: the buckets before show none." : "";
  return [
    chart({
      id: "usage-calls",
      title: refused ? `Model calls and 429s ${per}` : `Model calls ${per}`,
      desc: `Model calls (model_attempts rows)${refused ? " and requests answered 429" : ""} ${per} over ${span}, ` +
        `of ${who}.${forgotten}`,
      buckets,
      series: [
        { key: "calls", name: "calls", kind: "bar", values: f.calls, color: COLORS.calls },
        ...refusedBars,
      ],
      yLabel: per,
      xLabel,
      labelEvery,
      format: formatCount,
    }),
    chart({
      id: "usage-tokens",
      title: `Tokens ${per}${budgets ? ", against the daily budget" : ""}`,
      desc: `Prompt and completion tokens ${per} over ${span} of ${who}${running}${against(budgets?.tokens, "token")}`,
      buckets,
      stacked: true,
      series: [
        { key: "prompt", name: "prompt", kind: "bar", values: f.prompt, color: COLORS.prompt },
        { key: "completion", name: "completion", kind: "bar", values: f.completion, color: COLORS.completion },
        ...dayLine("tokens-today", (t) => t.tokens),
      ],
      limit: limitAt(budgets?.tokens),
      yLabel: "tokens",
      xLabel: lineAxis,
      labelEvery,
      format: formatCount,
    }),
    chart({
      id: "usage-spend",
      title: `Spend ${per} (USD)${budgets ? ", against the daily budget" : ""}`,
      desc: `The cost of ${who}'s calls ${per} over ${span} (the sum of cost_usd; unpriced calls count nothing)` +
        `${running}${against(budgets?.usd, "USD")}`,
      buckets,
      series: [
        { key: "spend", name: "spend", kind: "bar", values: f.cost, color: COLORS.spend },
        ...dayLine("spend-today", (t) => t.spend),
      ],
      limit: limitAt(budgets?.usd),
      yLabel: "USD",
      xLabel: lineAxis,
      labelEvery,
      format: formatUsd,
    }),
    chart({
      id: "usage-cache",
      title: `Cache hits ${per}`,
      desc: `Runs of ${who} answered from the result cache (cache_hits rows) ${per} over ${span}: no model call.`,
      buckets,
      series: [{ key: "hits", name: "cache hits", kind: "bar", values: f.hits, color: COLORS.hits }],
      yLabel: per,
      xLabel,
      labelEvery,
      format: formatCount,
    }),
  ];
}

/**
 * The totals of `f` as a `<dl>` with ids (`total-calls`); `more` figures (the usage page's 429s) follow the
 * calls.
 */
export function usageTotals(f: UsageFigures, more: [id: string, label: string, value: string][] = []): Html {
  return figures([
    ["total-calls", "calls", formatCount(sum(f.calls))],
    ...more,
    ["total-prompt", "prompt tokens", formatCount(sum(f.prompt))],
    ["total-completion", "completion tokens", formatCount(sum(f.completion))],
    ["total-cost", "cost", formatUsd(sum(f.cost)) + (f.unpriced ? ` (${formatCount(f.unpriced)} calls unpriced)` : "")],
    ["total-hits", "cache hits", formatCount(sum(f.hits))],
    ["total-saved", "saved by the cache", `${formatCount(sum(f.savedTokens))} tokens, ${formatUsd(sum(f.savedUsd))}`],
  ]);
}

/** The window's span in a sentence: from its first bucket's start to now, the last bucket in progress. */
export function windowSentence(win: UsageWindow, buckets: Bucket[], nowMs: number): string {
  return `per ${win.unit} over ${win.span}: from ${minuteOf(buckets[0]!.startMs)} UTC to now (${minuteOf(nowMs)} ` +
    `UTC); the last bucket, ${bucketRange(buckets.at(-1)!)}, is still in progress`;
}

/**
 * The usage page: for `tenant` (all tenants when unset), over `window` (`1h`, `24h` by default, or `7d`): model
 * calls and the 429s the API answered, tokens and spend per bucket with the day's running total (UTC) against
 * the daily budget, and cache hits; totals, and the tenant's budgets with what its recorded calls have spent.
 * Another `window` is a `400`.
 */
export async function usagePage(
  deps: PageDeps,
  view: View,
  { tenant, window: windowName }: { tenant?: string; window?: string },
): Promise<Response> {
  const win = usageWindow(windowName);
  if (!win) return unknownWindow(view, "Usage", "/console/usage", { tenant }, windowName!);
  const { sql } = deps;
  const now = deps.now?.() ?? Date.now();
  const { window, buckets } = clockWindow(now, win.widthMs, win.count);
  const listed = await usageTenants(sql, { sinceMs: window.fromMs, limit: PAGE_ROWS });
  const today = dayOf(now) * DAY_MS;
  const month = Date.UTC(new Date(now).getUTCFullYear(), new Date(now).getUTCMonth(), 1);
  const [f, refused, budgets, spentToday, spentMonth] = await Promise.all([
    usageFigures(sql, { tenant, window, buckets, dayToDate: true }),
    refusalsPerBucket(deps, tenant === undefined ? listed : [tenant], window, now),
    tenant === undefined ? undefined : tenantBudgets(sql, tenant),
    tenant === undefined ? undefined : spentSince(sql, tenant, today),
    tenant === undefined ? undefined : spentSince(sql, tenant, month),
  ]);
  const who = tenant === undefined ? "all tenants" : `tenant ${tenant}`;
  const firstKept = refused.findIndex((v) => v !== null);
  const refusedSince = firstKept > 0
    ? ` (since ${minuteOf(buckets[firstKept]!.startMs)} UTC; older 429s are not kept)`
    : "";
  const charts = usageCharts(f, {
    who,
    win,
    buckets,
    refused,
    budgets: {
      tokens: budgets?.budget_tokens_day == null ? null : Number(budgets.budget_tokens_day),
      usd: budgets?.budget_usd_day == null ? null : Number(budgets.budget_usd_day),
      none: tenant === undefined ? " Choose a tenant to see its budget." : " No daily budget is set.",
    },
  });
  const budgetRows = budgets && spentToday && spentMonth
    ? [
      ["day (UTC)", "tokens", budgets.budget_tokens_day, formatCount(spentToday.tokens)],
      ["day (UTC)", "USD", budgets.budget_usd_day, formatUsd(usd(spentToday.cost_usd))],
      ["month (UTC)", "tokens", budgets.budget_tokens_month, formatCount(spentMonth.tokens)],
      ["month (UTC)", "USD", budgets.budget_usd_month, formatUsd(usd(spentMonth.cost_usd))],
    ].map(([period, unit, limit, spent]) => [
      html`${period}`,
      html`${unit}`,
      html`${
        limit === null || limit === undefined
          ? "none"
          : unit === "USD"
          ? formatUsd(Number(limit))
          : formatCount(Number(limit))
      }`,
      html`${spent}`,
    ])
    : [];
  const body = html`${tenantSelector(listed, tenant, win)}${windowSwitch("/console/usage", { tenant }, win)}
<p>The usage of ${who}, ${windowSentence(win, buckets, now)}. ${
    raw(
      "Calls, tokens and cost are the rows of <code>model_attempts</code> (cost: the sum of <code>cost_usd</code>), " +
        "cache hits the rows of <code>cache_hits</code>: the figures of <code>GET /v1/usage</code>.",
    )
  }</p>
${usageTotals(f, [["total-refused", "429s", formatCount(sum(refused)) + refusedSince]])}
<div class="charts">${charts}</div>
${
    tenant === undefined ? "" : html`<h2>Budgets</h2>${
      table(
        ["period", "unit", "budget", "spent (recorded calls)"],
        budgetRows,
        "No budgets.",
      )
    }`
  }`;
  return page(view, "Usage", body);
}

/**
 * The queues page's charts over all tenants: jobs decided per bucket (done, failed, cancelled, expired) and the p50
 * and p99 latency from acceptance (the stream entry) to the outcome; per minute over the last hour, or with
 * `window` "24h" per hour over the last 24 hours.
 */
export async function queueCharts(deps: PageDeps, windowName: string | undefined): Promise<Html> {
  const day = windowName === "24h";
  const now = deps.now?.() ?? Date.now();
  const { window, buckets } = day ? clockWindow(now, HOUR_MS, 24) : clockWindow(now, MINUTE_MS, 60);
  const rows = await outcomesPerBucket(deps.sql, { window });
  const done = zeros(window), failed = zeros(window), cancelled = zeros(window), expired = zeros(window);
  const p50: (number | null)[] = buckets.map(() => null), p99: (number | null)[] = buckets.map(() => null);
  for (const r of rows) {
    done[r.bucket] = r.done;
    failed[r.bucket] = r.failed;
    cancelled[r.bucket] = r.cancelled;
    expired[r.bucket] = r.expired;
    p50[r.bucket] = r.p50_ms;
    p99[r.bucket] = r.p99_ms;
  }
  const unit = day ? "hour" : "minute";
  const span = day ? "the last 24 hours" : "the last hour";
  const xLabel = day ? "UTC hour" : "UTC minute";
  const switcher = day
    ? html`<a href="/console">last hour, per minute</a> · per hour over 24 hours`
    : html`per minute over the last hour · <a href="/console?window=24h">last 24 hours, per hour</a>`;
  return html`
    <h2>Throughput and latency</h2>
    <p class="switch">${switcher}</p>
    <div class="charts">${[
      chart({
        id: "queue-throughput",
        title: `Jobs decided per ${unit}`,
        desc: `Jobs and runs of every tenant decided per ${unit} over ${span} (job_outcomes by decided_at): done, ` +
          `failed (dead-lettered), cancelled, and expired (not started within their expires_in).`,
        buckets,
        stacked: true,
        series: [
          { key: "done", name: "done", kind: "bar", values: done, color: COLORS.done },
          { key: "failed", name: "failed", kind: "bar", values: failed, color: COLORS.failed },
          { key: "cancelled", name: "cancelled", kind: "bar", values: cancelled, color: COLORS.cancelled },
          { key: "expired", name: "expired", kind: "bar", values: expired, color: COLORS.expired },
        ],
        yLabel: `per ${unit}`,
        xLabel,
        format: formatCount,
      }),
      chart({
        id: "queue-latency",
        title: `Latency, accepted to decided, per ${unit}`,
        desc: `The median (p50) and p99 time from a job's acceptance (its stream entry) to its outcome, of the jobs ` +
          `decided in each ${unit} over ${span}; none where no job was decided.`,
        buckets,
        series: [
          { key: "p50", name: "p50", kind: "line", values: p50, color: COLORS.p50 },
          { key: "p99", name: "p99", kind: "line", values: p99, color: COLORS.p99 },
        ],
        yLabel: "latency",
        xLabel,
        format: formatMs,
      }),
    ]}</div>
  `;
}
