/**
 * The console's charts against known data: model calls with tokens and
 * costs (some unpriced, some before the window or on the day before), cache
 * hits, a tenant's budgets, 429s recorded per minute, and decided jobs with
 * known latencies are written straight into the test's own database and
 * Redis; the usage page and the queues page must draw exactly those figures
 * per bucket (each bar's and point's `data-value`, and its `<title>`). Both
 * pages are then rendered in headless Chromium, under the console's CSP:
 * the bars' drawn heights follow their values, and the screenshots (to
 * CONSOLE_SCREENSHOTS, or a temp dir) are not blank. The clock of the pages
 * is fixed at the test's start, so no assertion depends on the wall clock.
 * A 429 answered through the API is recorded for its tenant, in Redis and in
 * `oncely_tenant_refusals_total`.
 */
import { seedBudgetState } from "../../src/budgets/seed_script.ts";
import assert from "node:assert/strict";
import { clockWindow } from "../../src/console/chart_windows.ts";
import { createConsole } from "../../src/console/console.ts";
import { formatCount, formatUsd } from "../../src/console/charts.ts";
import { createPrices } from "../../src/llm/prices.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { apiMetrics, createRegistry } from "../../src/metrics/metrics.ts";
import {
  recordRefusal,
  REFUSAL_SERIES_TENANTS,
  refusalCounter,
  refusalsPerMinute,
} from "../../src/metrics/refusals.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { launchBrowser } from "../support/browser.ts";
import { figureOf, marksOf, valuesOf } from "../support/chart_marks.ts";
import { apiHandler, budgetsOn } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, seededRandom } from "../_support.ts";

const TOKEN = "charts-test-admin-token-0123456789";
const MINUTE = 60_000, HOUR = 3_600_000, DAY = 86_400_000;

interface Call {
  tenant: string;
  at: number;
  prompt: number;
  completion: number;
  /** USD; null: the model had no price. */
  cost: number | null;
}
interface Hit {
  tenant: string;
  at: number;
  tokens: number;
  usd: number;
}
interface Outcome {
  tenant: string;
  outcome: "done" | "failed" | "cancelled" | "expired";
  decided: number;
  /** Milliseconds from acceptance to outcome; null for an outcome that does not know when its job was accepted. */
  latency: number | null;
}

/** Postgres's `percentile_cont`, rounded to 0.1 as the page's query rounds it. */
function percentileCont(values: number[], p: number): number {
  const sorted = [...values].sort((a, b) => a - b);
  const pos = p * (sorted.length - 1);
  const lo = Math.floor(pos), hi = Math.ceil(pos);
  return Math.round((sorted[lo]! + (sorted[hi]! - sorted[lo]!) * (pos - lo)) * 10) / 10;
}

/** `actual` equals `expected` to within `tolerance` at every position. */
function near(actual: (number | null)[], expected: (number | null)[], tolerance: number, what: string) {
  assert.equal(actual.length, expected.length, `${what}: ${actual.length} values`);
  actual.forEach((a, i) => {
    const e = expected[i]!;
    if (a === null || e === null) assert.equal(a, e, `${what} [${i}]`);
    else assert.ok(Math.abs(a - e) <= tolerance, `${what} [${i}]: ${a} vs ${e}`);
  });
}

Deno.test("the usage page and the queue charts draw exactly the seeded figures, also in Chromium", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const shots = Deno.env.get("CONSOLE_SCREENSHOTS") ?? await Deno.makeTempDir({ prefix: "oncely-charts-" });
  await Deno.mkdir(shots, { recursive: true });
  // The pages' clock: fixed at the start, so every bucket below is computed from the same instant.
  const NOW = Date.now();
  const random = seededRandom(25);
  const int = (lo: number, hi: number) => lo + Math.floor(random() * (hi - lo + 1));
  const hours = clockWindow(NOW, HOUR, 24);
  const minutes = clockWindow(NOW, MINUTE, 60);
  // GET /v1/usage?since=24h counts from 24 hours before its request, the page from the start of the UTC hour
  // 23 hours before NOW's: no row is written between the two, nor within 3 minutes of either.
  const margin = 3 * MINUTE;
  const apiFrom = NOW - 24 * HOUR;
  /** A time inside `bucket`, never after NOW, nor near the 24 hours' start. */
  const inside = (b: { startMs: number; endMs: number }) =>
    Math.min(Math.max(b.startMs + int(1_000, b.endMs - b.startMs - 1_000), hours.window.fromMs + margin), NOW - 1_000);

  const calls: Call[] = [];
  const call = (tenant: string, at: number): Call => ({
    tenant,
    at,
    prompt: int(100, 999),
    completion: int(10, 250),
    // Whole nano-dollars, as the worker prices calls; one in ten unpriced.
    cost: random() < 0.1 ? null : int(1_000, 900_000) / 1e9,
  });
  for (const b of hours.buckets) {
    for (const tenant of ["acme", "globex"]) {
      for (let n = int(0, 5); n > 0; n--) calls.push(call(tenant, inside(b)));
    }
  }
  // Before the window on the window's first day (the running total since midnight counts them), and on the day
  // before (nothing counts them).
  const firstDay = Math.floor(hours.window.fromMs / DAY) * DAY;
  if (apiFrom - firstDay > margin + 2_000) calls.push(call("acme", int(firstDay + 1_000, apiFrom - margin)));
  calls.push(call("acme", Math.min(firstDay, apiFrom - margin) - 10 * MINUTE));
  const hits: Hit[] = [];
  for (const b of hours.buckets) {
    for (let n = int(0, 3); n > 0; n--) {
      hits.push({
        tenant: int(0, 2) ? "acme" : "globex",
        at: inside(b),
        tokens: int(50, 500),
        usd: int(1, 9_999) / 1e6,
      });
    }
  }
  const refusals: { tenant: string; at: number }[] = [];
  for (const b of hours.buckets) {
    for (let n = random() < 0.5 ? 0 : int(1, 4); n > 0; n--) {
      refusals.push({ tenant: int(0, 3) ? "acme" : "globex", at: inside(b) });
    }
  }
  const outcomes: Outcome[] = [];
  for (const b of minutes.buckets) {
    for (let n = int(0, 4); n > 0; n--) {
      const kind = random();
      outcomes.push({
        tenant: int(0, 1) ? "acme" : "globex",
        outcome: kind < 0.75 ? "done" : kind < 0.85 ? "failed" : kind < 0.93 ? "cancelled" : "expired",
        decided: inside(b),
        latency: random() < 0.15 ? null : int(40, 6_000),
      });
    }
  }

  const acmeKey = await createApiKey(db.sql, "acme");
  await createApiKey(db.sql, "globex");
  await db.sql`
    INSERT INTO model_attempts (job_id, tenant, delivery, attempt, started_at, duration_ms, outcome, status,
      prompt_tokens, completion_tokens, model, cost_usd)
    SELECT gen_random_uuid(), tenant, 1, 1, to_timestamp(at / 1000), 100, 'ok', 200, prompt, completion, 'gpt-test',
      cost
    FROM unnest(${calls.map((c) => c.tenant)}::text[], ${calls.map((c) => c.at)}::float8[],
      ${calls.map((c) => c.prompt)}::int[], ${calls.map((c) => c.completion)}::int[],
      ${calls.map((c) => (c.cost === null ? null : c.cost.toFixed(9)))}::numeric[])
      AS t(tenant, at, prompt, completion, cost)`;
  await db.sql`
    INSERT INTO cache_hits (run_id, tenant, task, version, model, source_run_id, saved_prompt_tokens,
      saved_completion_tokens, saved_usd, created_at)
    SELECT gen_random_uuid(), tenant, 'summarize', 1, 'gpt-test', gen_random_uuid(), tokens, 0, usd,
      to_timestamp(at / 1000)
    FROM unnest(${hits.map((h) => h.tenant)}::text[], ${hits.map((h) => h.at)}::float8[],
      ${hits.map((h) => h.tokens)}::int[], ${
    hits.map((h) => h.usd.toFixed(6))
  }::numeric[]) AS t(tenant, at, tokens, usd)`;
  await db.sql`
    INSERT INTO job_outcomes (job_id, tenant, outcome, decided_at, accepted_at)
    SELECT gen_random_uuid(), tenant, outcome, to_timestamp(decided / 1000), to_timestamp((decided - latency) / 1000)
    FROM unnest(${outcomes.map((o) => o.tenant)}::text[], ${outcomes.map((o) => o.outcome)}::text[],
      ${outcomes.map((o) => o.decided)}::float8[], ${outcomes.map((o) => o.latency)}::float8[])
      AS t(tenant, outcome, decided, latency)`;
  for (const x of refusals) await recordRefusal(r.redis, keys, x.tenant, 429, x.at);

  // acme's daily budgets: the busier of the window's two days comes to about three quarters of them.
  const byDay = (of: (c: Call) => number) => {
    const days = new Map<number, number>();
    for (const c of calls) {
      if (c.tenant === "acme") days.set(Math.floor(c.at / DAY), (days.get(Math.floor(c.at / DAY)) ?? 0) + of(c));
    }
    return Math.max(...days.values());
  };
  const TOKENS_DAY = Math.round(byDay((c) => c.prompt + c.completion) * 1.3);
  const USD_DAY = Number((byDay((c) => c.cost ?? 0) * 1.3).toFixed(4));
  await db.sql`UPDATE tenants SET budget_tokens_day = ${TOKENS_DAY}, budget_usd_day = ${USD_DAY},
    budget_tokens_month = 5000000, budget_usd_month = 25 WHERE name = 'acme'`;

  const handler = apiHandler({ redis: r.redis, sql: db.sql, keys }, {
    authMode: "api-key",
    console: await createConsole({
      redis: r.redis,
      sql: db.sql,
      keys,
      log: silentLogger,
      token: TOKEN,
      maxBodyBytes: 1 << 20,
      auth: { turnMs: 10 },
      now: () => NOW,
    }),
  });
  const get = async (path: string) => {
    const res = await handler(new Request(`http://api${path}`, { headers: { authorization: `Bearer ${TOKEN}` } }));
    assert.equal(res.status, 200, path);
    return { csp: res.headers.get("content-security-policy")!, body: await res.text() };
  };

  /** Per hourly bucket: the sum of `of` over `rows` of `tenant` (all when unset) in it. */
  const perHour = <T extends { at: number; tenant: string }>(rows: T[], of: (x: T) => number, tenant?: string) =>
    hours.buckets.map((b) =>
      rows.filter((x) => (tenant === undefined || x.tenant === tenant) && x.at >= b.startMs && x.at < b.endMs)
        .reduce((s, x) => s + of(x), 0)
    );
  /** Today's running total at each bucket's end: the calls of the day the bucket ends in, up to its end. */
  const runningTotal = (of: (c: Call) => number, tenant?: string) =>
    hours.buckets.map((b) => {
      const day = Math.floor((b.endMs - 1) / DAY) * DAY;
      return calls.filter((c) => (tenant === undefined || c.tenant === tenant) && c.at >= day && c.at < b.endMs)
        .reduce((s, c) => s + of(c), 0);
    });
  const usageOf = (body: string, tenant?: string) => {
    near(valuesOf(body, "usage-calls", "calls"), perHour(calls, () => 1, tenant), 0, "calls");
    near(valuesOf(body, "usage-calls", "refused"), perHour(refusals, () => 1, tenant), 0, "429s");
    near(valuesOf(body, "usage-tokens", "prompt"), perHour(calls, (c) => c.prompt, tenant), 0, "prompt tokens");
    near(valuesOf(body, "usage-tokens", "completion"), perHour(calls, (c) => c.completion, tenant), 0, "completion");
    near(
      valuesOf(body, "usage-tokens", "tokens-today"),
      runningTotal((c) => c.prompt + c.completion, tenant),
      0,
      "tokens today so far",
    );
    near(valuesOf(body, "usage-spend", "spend"), perHour(calls, (c) => c.cost ?? 0, tenant), 1e-9, "spend");
    near(valuesOf(body, "usage-spend", "spend-today"), runningTotal((c) => c.cost ?? 0, tenant), 1e-9, "spend today");
    near(valuesOf(body, "usage-cache", "hits"), perHour(hits, () => 1, tenant), 0, "cache hits");
  };
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen() {} }, (req) => handler(req));
  const base = `http://127.0.0.1:${server.addr.port}`;
  const browser = await launchBrowser();

  try {
    await t.step(
      "the usage page of one tenant: every bucket of every chart, the totals and the budget lines",
      async () => {
        const { csp, body } = await get("/console/usage?tenant=acme");
        assert.match(csp, /default-src 'none'; style-src 'self'; script-src 'self'/, "the console's CSP, unchanged");
        assert.match(body, /<a href="\/console\/usage">Usage<\/a>/, "in the navigation");
        assert.ok(!/<svg[^>]* style=|<style/.test(body), "no style attribute or element: nothing the CSP would block");
        usageOf(body, "acme");
        const calls24 = calls.filter((c) => c.tenant === "acme" && c.at >= hours.window.fromMs);
        assert.equal(figureOf(body, "total-calls"), calls24.length.toLocaleString("en-US"));
        assert.equal(figureOf(body, "total-refused"), String(refusals.filter((x) => x.tenant === "acme").length));
        assert.equal(figureOf(body, "total-hits"), String(hits.filter((h) => h.tenant === "acme").length));
        const unpriced = calls24.filter((c) => c.cost === null).length;
        if (unpriced) assert.match(figureOf(body, "total-cost")!, new RegExp(`\\(${unpriced} calls unpriced\\)$`));
        // The budget lines: dashed, at the budget, labelled with it.
        assert.match(body, new RegExp(`<line data-limit="${TOKENS_DAY}"[^>]*stroke-dasharray="6 4"`));
        assert.match(body, new RegExp(`<line data-limit="${USD_DAY}"[^>]*stroke-dasharray="6 4"`));
        assert.ok(body.includes(`budget per day: ${TOKENS_DAY.toLocaleString("en-US")}</text>`));
        // The running totals start afresh after midnight: one stretch of line per day the buckets end in.
        const days = new Set(hours.buckets.map((b) => Math.floor((b.endMs - 1) / DAY))).size;
        for (const id of ["usage-tokens", "usage-spend"]) {
          const svg = body.slice(body.indexOf(`id="${id}"`));
          assert.equal(/<path d="([^"]+)"/.exec(svg)![1]!.split("M").length - 1, days, `${id}: one line per day`);
        }
        // Accessible: a title and a description for each chart, a title for each bar, a table of the figures.
        for (const id of ["usage-calls", "usage-tokens", "usage-spend", "usage-cache"]) {
          assert.match(body, new RegExp(`aria-labelledby="${id}-title ${id}-desc"`));
          assert.match(body, new RegExp(`<title id="${id}-title">[^<]+</title><desc id="${id}-desc">[^<]+</desc>`));
        }
        const bar = marksOf(body, "usage-calls").get("calls")![3]!;
        assert.match(bar.title, /^\d{4}-\d\d-\d\d \d\d:\d\d–\d\d:\d\d UTC: calls \d+$/);
        assert.equal(bar.bucket, new Date(hours.buckets[3]!.startMs).toISOString());
        assert.equal((body.match(/<summary>Figures<\/summary>/g) ?? []).length, 4);
      },
    );

    await t.step("the usage page's figures are GET /v1/usage's, for the same tenant and 24 hours", async () => {
      const res = await handler(
        new Request("http://api/v1/usage?since=24h", { headers: { authorization: `Bearer ${acmeKey}` } }),
      );
      assert.equal(res.status, 200);
      const { totals } = await res.json();
      const { body } = await get("/console/usage?tenant=acme");
      const sum = (id: string, series: string) => valuesOf(body, id, series).reduce((a, b) => a! + (b ?? 0), 0)!;
      assert.equal(sum("usage-calls", "calls"), totals.calls);
      assert.equal(sum("usage-tokens", "prompt"), totals.tokens.prompt);
      assert.equal(sum("usage-tokens", "completion"), totals.tokens.completion);
      assert.ok(Math.abs(sum("usage-spend", "spend") - totals.cost_usd) < 1e-9, `${totals.cost_usd}`);
      assert.equal(sum("usage-cache", "hits"), totals.cache_hits);
      assert.equal(figureOf(body, "total-calls"), formatCount(totals.calls));
      assert.equal(
        figureOf(body, "total-cost"),
        formatUsd(totals.cost_usd) + (totals.unpriced_calls ? ` (${totals.unpriced_calls} calls unpriced)` : ""),
      );
      const saved = totals.saved;
      assert.equal(
        figureOf(body, "total-saved"),
        `${formatCount(saved.tokens.prompt + saved.tokens.completion)} tokens, ${formatUsd(saved.cost_usd ?? 0)}`,
      );
    });

    await t.step("all tenants: the sums; another tenant without a budget: no budget line", async () => {
      const all = await get("/console/usage");
      usageOf(all.body);
      assert.ok(!all.body.includes("data-limit="), "budgets are per tenant");
      assert.match(all.body, /<option value="acme"\s*>acme<\/option>\s*<option value="globex"\s*>globex<\/option>/);
      const globex = await get("/console/usage?tenant=globex");
      usageOf(globex.body, "globex");
      assert.ok(!globex.body.includes("data-limit="));
      assert.match(globex.body, /<option value="globex"\s+selected\s*>/);
    });

    await t.step("the queues page: jobs decided per minute by outcome (expired too), p50 and p99 latency", async () => {
      const { body } = await get("/console");
      const inMinute = (b: { startMs: number; endMs: number }) =>
        outcomes.filter((o) => o.decided >= b.startMs && o.decided < b.endMs);
      for (const kind of ["done", "failed", "cancelled", "expired"] as const) {
        assert.ok(outcomes.some((o) => o.outcome === kind), `the seeded outcomes include ${kind}`);
        near(
          valuesOf(body, "queue-throughput", kind),
          minutes.buckets.map((b) => inMinute(b).filter((o) => o.outcome === kind).length),
          0,
          kind,
        );
      }
      const latencies = minutes.buckets.map((b) =>
        inMinute(b).map((o) => o.latency).filter((l): l is number => l !== null)
      );
      const expected = (p: number) => latencies.filter((l) => l.length > 0).map((l) => percentileCont(l, p));
      near(valuesOf(body, "queue-latency", "p50"), expected(0.5), 0.051, "p50");
      near(valuesOf(body, "queue-latency", "p99"), expected(0.99), 0.051, "p99");
      // Over 24 hours, per hour: every outcome falls in the last hour or two.
      const day = await get("/console?window=24h");
      const done = valuesOf(day.body, "queue-throughput", "done");
      assert.equal(done.length, 24);
      assert.equal(done.reduce((s, v) => s! + v!, 0), outcomes.filter((o) => o.outcome === "done").length);
    });

    await t.step("in Chromium: signed in, the charts draw their figures, bars as tall as their values", async () => {
      await browser.goto(`${base}/console/login`);
      await browser.eval(`document.querySelector("input[name=token]").value = ${JSON.stringify(TOKEN)}`);
      await browser.navigateBy(`document.querySelector("form").submit()`);
      assert.match(await browser.goto(`${base}/console/usage?tenant=acme`), /\/console\/usage\?tenant=acme$/);
      const bars = (chart: string, series: string) =>
        browser.eval<{ value: number; height: number; title: string }[]>(
          `[...document.querySelectorAll("#${chart} rect[data-series=${series}]")].map((r) => ({
          value: Number(r.dataset.value), height: r.getBBox().height, title: r.querySelector("title").textContent }))`,
        );
      const prompt = await bars("usage-tokens", "prompt");
      near(prompt.map((d) => d.value), perHour(calls, (c) => c.prompt, "acme"), 0, "prompt tokens in the browser");
      const drawn = await bars("usage-calls", "calls");
      near(drawn.map((d) => d.value), perHour(calls, () => 1, "acme"), 0, "calls in the browser");
      const tallest = drawn.reduce((a, b) => (b.value > a.value ? b : a));
      assert.ok(tallest.height > 20, "drawn");
      for (const d of drawn) {
        assert.ok(Math.abs(d.height - (d.value / tallest.value) * tallest.height) < 0.05, `${d.title}: ${d.height}`);
      }
      const limit = await browser.eval<{ y: number; dash: string }>(
        `(() => { const l = document.querySelector("#usage-tokens line[data-limit]");
          return { y: l.getBBox().y, dash: getComputedStyle(l).strokeDasharray }; })()`,
      );
      assert.match(limit.dash, /^6(px)?,? 4(px)?$/);
      const charts = await browser.eval<number[]>(
        `[...document.querySelectorAll("svg.chart")].map((s) => s.getBoundingClientRect().width)`,
      );
      assert.equal(charts.length, 4);
      assert.ok(charts.every((w) => w > 400), `rendered widths ${charts}`);
      await browser.screenshot(`${shots}/usage.png`);
      await browser.goto(`${base}/console`);
      const p99 = await browser.eval<number[]>(
        `[...document.querySelectorAll("#queue-latency circle[data-series=p99]")].map((c) => Number(c.dataset.value))`,
      );
      assert.ok(p99.length > 0);
      await browser.screenshot(`${shots}/queues.png`);
      for (const name of ["usage.png", "queues.png"]) {
        const size = (await Deno.stat(`${shots}/${name}`)).size;
        assert.ok(size > 20_000, `${name} is not blank (${size} bytes)`);
      }
    });
  } finally {
    console.log(`chart screenshots: ${shots}`);
    await browser.close();
    await server.shutdown();
    await r.close();
    await db.close();
  }
});

Deno.test("a 429 for a spent budget is recorded per minute for its tenant, and counted in /metrics", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const registry = createRegistry();
  try {
    // acme's daily budget of 5,000 tokens is nearly spent: a new run's worst case no longer fits, so the API
    // answers 429 (a worst case over the whole budget would be a 422: it could never fit).
    await createApiKey(db.sql, "acme");
    await db.sql`UPDATE tenants SET budget_tokens_day = 5000 WHERE name = 'acme'`;
    await seedBudgetState(r.redis, keys.budget("acme"), [4_900, 0, 4_900, 0]);
    const prices = createPrices({ LLM_PRICES: { "default-model": { in: 0.4, out: 1.6 } } });
    const handler = apiHandler({ redis: r.redis, sql: db.sql, keys }, {
      metrics: { api: apiMetrics(registry), registry },
      budgets: budgetsOn({ redis: r.redis, sql: db.sql, keys }, { prices }),
      defaultModel: "default-model",
    });
    const before = Date.now();
    for (let i = 0; i < 3; i++) {
      const res = await handler(
        new Request("http://api/v1/summaries", {
          method: "POST",
          headers: {
            "x-tenant-id": "acme",
            "idempotency-key": `charts-429-test-000${i}`,
            "content-type": "application/json",
          },
          body: JSON.stringify({ text: "A document.", notify: "ops@example.com" }),
        }),
      );
      assert.equal(res.status, 429);
      assert.equal((await res.json()).title, "Budget exhausted");
    }
    const unauthenticated = await handler(new Request("http://api/v1/summaries", { method: "POST" }));
    assert.equal(unauthenticated.status, 401);
    await unauthenticated.body?.cancel();
    const counted = async () => {
      const minutes = await refusalsPerMinute(r.redis, keys, "acme", {
        fromMs: before - MINUTE,
        toMs: Date.now() + MINUTE,
      });
      return [...minutes.values()].reduce((a, b) => a + b, 0);
    };
    // Fire-and-forget: the record follows the answer within a moment.
    for (let i = 0; i < 100 && (await counted()) < 3; i++) await new Promise((resolve) => setTimeout(resolve, 10));
    assert.equal(await counted(), 3);
    const ttl = Math.max(
      ...await Promise.all(
        [before, Date.now()].map((ms) => r.redis.ttl(`${keys.prefix}:{t:acme}:refusals:${Math.floor(ms / HOUR)}`)),
      ),
    );
    assert.ok(ttl > 24 * 3600 && ttl <= 25 * 3600, `kept 25 hours (${ttl} s)`);
    assert.match(await registry.metrics(), /oncely_tenant_refusals_total\{tenant="acme",status="429"\} 3/);
  } finally {
    await r.close();
    await db.close();
  }
});

Deno.test("oncely_tenant_refusals_total stays bounded: tenants past the first 100 count as other", async () => {
  const registry = createRegistry();
  const count = refusalCounter(registry);
  assert.equal(refusalCounter(registry), count, "registered once per registry");
  for (let i = 0; i < REFUSAL_SERIES_TENANTS + 5; i++) count(`tenant-${i}`, 429);
  count("tenant-0", 429);
  const text = await registry.metrics();
  assert.match(text, /oncely_tenant_refusals_total\{tenant="tenant-0",status="429"\} 2/);
  assert.match(text, /oncely_tenant_refusals_total\{tenant="other",status="429"\} 5/);
  assert.equal(text.match(/^oncely_tenant_refusals_total\{/gm)?.length, REFUSAL_SERIES_TENANTS + 1);
});
