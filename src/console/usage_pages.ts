/**
 * The console's pictures: the usage page (`/console/usage`, per tenant or
 * all tenants, the last 24 hours by hour: calls and 429s, tokens and spend
 * against the daily budget, cache hits) and the queues page's charts
 * (throughput and latency per minute over the last hour, or per hour over
 * 24 hours). The figures come from the same rows, with the same definitions,
 * as `GET /v1/usage` (`src/jobs/usage_series.ts`); 429s from the API's
 * per-minute record (`src/metrics/refusals.ts`).
 */
import {
  cacheHitsPerBucket,
  outcomesPerBucket,
  spentSince,
  tenantBudgets,
  usagePerBucket,
  usageTenants,
  type Window,
} from "../jobs/usage_series.ts";
import { refusalsPerMinute } from "../metrics/refusals.ts";
import { type Bucket, chart, formatCount, formatMs, formatUsd } from "./charts.ts";
import { type Html, html, raw } from "./html.ts";
import { page, PAGE_ROWS, table, type View } from "./layout.ts";
import type { PageDeps } from "./pages.ts";

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
  p50: "#3b6fb6",
  p99: "#e08a1e",
};

/**
 * `count` buckets of `widthMs` ending with the minute that holds `nowMs` (windows end on a minute, so the
 * per-minute record of 429s falls into them whole).
 */
export function windowEndingAt(nowMs: number, widthMs: number, count: number): { window: Window; buckets: Bucket[] } {
  const end = (Math.floor(nowMs / MINUTE_MS) + 1) * MINUTE_MS;
  const fromMs = end - widthMs * count;
  const buckets = Array.from({ length: count }, (_, i) => {
    const startMs = fromMs + i * widthMs;
    return { startMs, endMs: startMs + widthMs, label: new Date(startMs).toISOString().slice(11, 16) };
  });
  return { window: { fromMs, widthMs, count }, buckets };
}

/** Figures from Postgres's numeric text; 0 for none. */
const usd = (text: string | null | undefined) => (text ? Number(text) : 0);

/** Zeros, one per bucket. */
const zeros = (w: Window) => Array.from({ length: w.count }, () => 0);

/** The 429s of `tenants` per bucket of `window`, summed. */
async function refusalsPerBucket(deps: PageDeps, tenants: string[], window: Window): Promise<number[]> {
  const out = zeros(window);
  const toMs = window.fromMs + window.count * window.widthMs;
  const each = await Promise.all(
    tenants.map((t) => refusalsPerMinute(deps.redis, deps.keys.prefix, t, { fromMs: window.fromMs, toMs })),
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

/** The tenant selector: a GET form, no script. */
function tenantSelector(tenants: string[], selected: string | undefined): Html {
  const options = tenants.map((t) =>
    html`
      <option value="${t}" ${t === selected ? raw(" selected") : ""}>${t}</option>
    `
  );
  return html`<form method="get" action="/console/usage" class="selector"><label>Tenant <select name="tenant">
    <option value=""${selected === undefined ? raw(" selected") : ""}>All tenants</option>${options}</select></label>
    <button>Show</button></form>`;
}

/**
 * The usage page: for `tenant` (all tenants when unset), the last 24 hours by hour: model calls and the 429s
 * the API answered, tokens and spend per hour with today's running total (UTC) against the daily budget, and
 * cache hits; totals, and the tenant's budgets with what its recorded calls have spent.
 */
export async function usagePage(deps: PageDeps, view: View, tenant: string | undefined): Promise<Response> {
  const { sql } = deps;
  const now = deps.now?.() ?? Date.now();
  const { window, buckets } = windowEndingAt(now, HOUR_MS, 24);
  const dayOf = (ms: number) => Math.floor(ms / DAY_MS);
  const listed = await usageTenants(sql, { sinceMs: window.fromMs, limit: PAGE_ROWS });
  const today = dayOf(now) * DAY_MS;
  const month = Date.UTC(new Date(now).getUTCFullYear(), new Date(now).getUTCMonth(), 1);
  const [usage, hits, refused, budgets, spentToday, spentMonth] = await Promise.all([
    // From midnight (UTC) of the window's first day: the running totals since midnight need it.
    usagePerBucket(sql, { tenant, window, sinceMs: dayOf(window.fromMs) * DAY_MS }),
    cacheHitsPerBucket(sql, { tenant, window }),
    refusalsPerBucket(deps, tenant === undefined ? listed : [tenant], window),
    tenant === undefined ? undefined : tenantBudgets(sql, tenant),
    tenant === undefined ? undefined : spentSince(sql, tenant, today),
    tenant === undefined ? undefined : spentSince(sql, tenant, month),
  ]);

  const calls = zeros(window), prompt = zeros(window), completion = zeros(window), cost = zeros(window);
  let unpriced = 0;
  for (const r of usage) {
    if (r.bucket < 0) continue;
    calls[r.bucket]! += r.calls;
    prompt[r.bucket]! += r.prompt_tokens;
    completion[r.bucket]! += r.completion_tokens;
    cost[r.bucket]! += usd(r.cost_usd);
    unpriced += r.unpriced;
  }
  // Today's running total at each bucket's end: the calls of the day that bucket ends in, up to its end.
  const runningTotal = (of: (r: (typeof usage)[number]) => number) =>
    buckets.map((b, i) => {
      const day = dayOf(b.endMs - 1);
      return usage.filter((r) => r.day === day && r.bucket <= i).reduce((sum, r) => sum + of(r), 0);
    });
  // The running totals start afresh at the first bucket that ends on a new day.
  const restarts = buckets.map((b, i) => i > 0 && dayOf(b.endMs - 1) !== dayOf(buckets[i - 1]!.endMs - 1));
  const tokensToday = runningTotal((r) => r.prompt_tokens + r.completion_tokens);
  const spendToday = runningTotal((r) => usd(r.cost_usd));
  const hitCount = zeros(window), savedTokens = zeros(window), savedUsd = zeros(window);
  for (const h of hits) {
    hitCount[h.bucket]! += h.hits;
    savedTokens[h.bucket]! += h.saved_tokens;
    savedUsd[h.bucket]! += usd(h.saved_usd);
  }
  const sum = (xs: number[]) => xs.reduce((a, b) => a + b, 0);
  const who = tenant === undefined ? "all tenants" : `tenant ${tenant}`;
  const perHour = "UTC hour (bars: per hour; line: the day so far, since 00:00 UTC)";
  const tokenBudget = budgets?.budget_tokens_day ?? null;
  const usdBudget = budgets?.budget_usd_day ?? null;
  const noBudget = tenant === undefined ? " Choose a tenant to see its budget." : " No daily budget is set.";

  const charts = [
    chart({
      id: "usage-calls",
      title: "Model calls and 429s per hour",
      desc: `Model calls (model_attempts rows) and requests answered 429, per hour over the last 24 hours, of ${who}.`,
      buckets,
      series: [
        { key: "calls", name: "calls", kind: "bar", values: calls, color: COLORS.calls },
        { key: "refused", name: "429s", kind: "bar", values: refused, color: COLORS.refused },
      ],
      yLabel: "per hour",
      xLabel: "UTC hour",
      format: formatCount,
    }),
    chart({
      id: "usage-tokens",
      title: "Tokens per hour, against the daily budget",
      desc: `Prompt and completion tokens per hour of ${who}, and the day's running total (since 00:00 UTC) ` +
        `against the daily token budget.${tokenBudget === null ? noBudget : ""}`,
      buckets,
      stacked: true,
      series: [
        { key: "prompt", name: "prompt", kind: "bar", values: prompt, color: COLORS.prompt },
        { key: "completion", name: "completion", kind: "bar", values: completion, color: COLORS.completion },
        {
          key: "tokens-today",
          name: "day so far",
          kind: "line",
          values: tokensToday,
          color: COLORS.today,
          at: "end",
          restarts,
        },
      ],
      limit: tokenBudget === null ? undefined : { value: Number(tokenBudget), label: "budget per day" },
      yLabel: "tokens",
      xLabel: perHour,
      format: formatCount,
    }),
    chart({
      id: "usage-spend",
      title: "Spend per hour (USD), against the daily budget",
      desc: `The cost of ${who}'s calls per hour (the sum of cost_usd; unpriced calls count nothing), and ` +
        `the day's running total (since 00:00 UTC) against the daily USD budget.${usdBudget === null ? noBudget : ""}`,
      buckets,
      series: [
        { key: "spend", name: "spend", kind: "bar", values: cost, color: COLORS.spend },
        {
          key: "spend-today",
          name: "day so far",
          kind: "line",
          values: spendToday,
          color: COLORS.today,
          at: "end",
          restarts,
        },
      ],
      limit: usdBudget === null ? undefined : { value: Number(usdBudget), label: "budget per day" },
      yLabel: "USD",
      xLabel: perHour,
      format: formatUsd,
    }),
    chart({
      id: "usage-cache",
      title: "Cache hits per hour",
      desc: `Runs of ${who} answered from the result cache (cache_hits rows) per hour: no model call.`,
      buckets,
      series: [{ key: "hits", name: "cache hits", kind: "bar", values: hitCount, color: COLORS.hits }],
      yLabel: "per hour",
      xLabel: "UTC hour",
      format: formatCount,
    }),
  ];
  const totals = figures([
    ["total-calls", "calls", formatCount(sum(calls))],
    ["total-refused", "429s", formatCount(sum(refused))],
    ["total-prompt", "prompt tokens", formatCount(sum(prompt))],
    ["total-completion", "completion tokens", formatCount(sum(completion))],
    ["total-cost", "cost", formatUsd(sum(cost)) + (unpriced ? ` (${formatCount(unpriced)} calls unpriced)` : "")],
    ["total-hits", "cache hits", formatCount(sum(hitCount))],
    ["total-saved", "saved by the cache", `${formatCount(sum(savedTokens))} tokens, ${formatUsd(sum(savedUsd))}`],
  ]);
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
  const body = html`${tenantSelector(listed, tenant)}
<p>The last 24 hours of ${who}, by hour, to ${new Date(window.fromMs + 24 * HOUR_MS).toISOString().slice(0, 16)} UTC. ${
    raw(
      "Calls, tokens and cost are the rows of <code>model_attempts</code> (cost: the sum of <code>cost_usd</code>), " +
        "cache hits the rows of <code>cache_hits</code>: the figures of <code>GET /v1/usage</code>.",
    )
  }</p>
${totals}
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
 * The queues page's charts over all tenants: jobs decided per bucket (done, failed, cancelled) and the p50
 * and p99 latency from acceptance (the stream entry) to the outcome; per minute over the last hour, or with
 * `window` "24h" per hour over the last 24 hours.
 */
export async function queueCharts(deps: PageDeps, windowName: string | undefined): Promise<Html> {
  const day = windowName === "24h";
  const now = deps.now?.() ?? Date.now();
  const { window, buckets } = day ? windowEndingAt(now, HOUR_MS, 24) : windowEndingAt(now, MINUTE_MS, 60);
  const rows = await outcomesPerBucket(deps.sql, { window });
  const done = zeros(window), failed = zeros(window), cancelled = zeros(window);
  const p50: (number | null)[] = buckets.map(() => null), p99: (number | null)[] = buckets.map(() => null);
  for (const r of rows) {
    done[r.bucket] = r.done;
    failed[r.bucket] = r.failed;
    cancelled[r.bucket] = r.cancelled;
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
          `failed (dead-lettered) and cancelled.`,
        buckets,
        stacked: true,
        series: [
          { key: "done", name: "done", kind: "bar", values: done, color: COLORS.done },
          { key: "failed", name: "failed", kind: "bar", values: failed, color: COLORS.failed },
          { key: "cancelled", name: "cancelled", kind: "bar", values: cancelled, color: COLORS.cancelled },
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
