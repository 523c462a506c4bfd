/**
 * The usage page's windows (`?window=1h|24h|7d`): buckets on the UTC clock
 * (minutes, hours, 6 hours from midnight), the last one in progress, with
 * the page's clock fixed; each window's bucket count, axis labels, units and
 * figures against calls written at known instants (some a millisecond
 * either side of a boundary), the day's running total starting afresh at
 * each UTC midnight, 429s older than Redis keeps them shown as none, the
 * links between windows keeping the tenant, and an unknown window.
 */
import assert from "node:assert/strict";
import { clockWindow, USAGE_WINDOWS } from "../../src/console/chart_windows.ts";
import { createConsole } from "../../src/console/console.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { recordRefusal } from "../../src/metrics/refusals.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { figureOf, marksOf, svgOf, valuesOf } from "../support/chart_marks.ts";
import { recordAttempt } from "../support/run_rows.ts";
import { createTestDatabase, createTestRedis } from "../_support.ts";

const TOKEN = "usage-windows-test-admin-token-0123";
const MINUTE = 60_000, HOUR = 3_600_000, DAY = 86_400_000;
/** The pages' clock: Thursday 2026-12-03, 14:37:25.500 UTC. */
const NOW = Date.UTC(2026, 11, 3, 14, 37, 25, 500);
const at = (iso: string) => Date.parse(`${iso}Z`);

/** The x axis's labels of chart `id`, in order. */
function axisLabels(body: string, id: string): string[] {
  return [...svgOf(body, id).matchAll(/<text x="[\d.]+" y="230" text-anchor="middle">([^<]+)<\/text>/g)].map((m) =>
    m[1]!
  );
}

Deno.test("clockWindow(): buckets start on the UTC clock and the last one holds now", () => {
  const iso = (ms: number) => new Date(ms).toISOString();
  const minutes = clockWindow(NOW, MINUTE, 60);
  assert.equal(minutes.buckets.length, 60);
  assert.equal(iso(minutes.buckets[0]!.startMs), "2026-12-03T13:38:00.000Z");
  assert.equal(iso(minutes.buckets.at(-1)!.startMs), "2026-12-03T14:37:00.000Z");
  assert.deepEqual([minutes.buckets[0]!.label, minutes.buckets.at(-1)!.label], ["13:38", "14:37"]);

  const hours = clockWindow(NOW, HOUR, 24);
  assert.equal(iso(hours.window.fromMs), "2026-12-02T15:00:00.000Z");
  assert.equal(iso(hours.buckets.at(-1)!.startMs), "2026-12-03T14:00:00.000Z");
  assert.equal(iso(hours.buckets.at(-1)!.endMs), "2026-12-03T15:00:00.000Z");
  assert.ok(hours.buckets.every((b) => b.startMs % HOUR === 0 && b.endMs - b.startMs === HOUR), "on the hour");
  assert.deepEqual(hours.buckets.slice(0, 3).map((b) => b.label), ["15:00", "16:00", "17:00"]);

  const days = clockWindow(NOW, 6 * HOUR, 28);
  assert.equal(iso(days.window.fromMs), "2026-11-26T18:00:00.000Z");
  assert.equal(iso(days.buckets.at(-1)!.startMs), "2026-12-03T12:00:00.000Z");
  assert.deepEqual(days.buckets.slice(0, 2).map((b) => b.label), ["11-26 18:00", "11-27 00:00"], "with the date");

  // Exactly on the hour, the hour just begun is the last bucket; a millisecond before, the hour before is.
  const onTheHour = Date.UTC(2026, 11, 3, 14);
  assert.equal(iso(clockWindow(onTheHour, HOUR, 24).buckets.at(-1)!.startMs), "2026-12-03T14:00:00.000Z");
  assert.equal(iso(clockWindow(onTheHour - 1, HOUR, 24).buckets.at(-1)!.startMs), "2026-12-03T13:00:00.000Z");
  assert.deepEqual(USAGE_WINDOWS.map((w) => [w.name, w.count, w.widthMs]), [
    ["1h", 60, MINUTE],
    ["24h", 24, HOUR],
    ["7d", 28, 6 * HOUR],
  ]);
});

Deno.test("the usage page's windows: buckets, labels, units, figures, links and a bad window", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  // acme's calls, each with its own power of two as prompt tokens: a bucket's sum names the calls in it.
  const calls = [
    { at: at("2026-11-26T17:59:59.999"), prompt: 1 }, // the 7 days' first day, before their first bucket
    { at: at("2026-11-26T18:00:00.000"), prompt: 2 }, // the 7 days' first bucket
    { at: at("2026-12-02T14:59:59.999"), prompt: 4 }, // a millisecond before the 24 hours
    { at: at("2026-12-02T15:00:00.000"), prompt: 8 }, // the 24 hours' first bucket
    { at: at("2026-12-02T23:30:00.000"), prompt: 16 }, // the day before today
    { at: at("2026-12-03T13:37:59.999"), prompt: 32 }, // today, a millisecond before the hour's window
    { at: at("2026-12-03T13:59:59.999"), prompt: 64 }, // the hour before this one
    { at: at("2026-12-03T14:00:00.000"), prompt: 128 }, // this hour's first millisecond
    { at: at("2026-12-03T14:37:00.000"), prompt: 256 }, // this minute
  ];
  const operatorConsole = await createConsole({
    redis: r.redis,
    sql: db.sql,
    keys,
    log: silentLogger,
    token: TOKEN,
    maxBodyBytes: 1 << 20,
    auth: { turnMs: 10 },
    now: () => NOW,
  });
  const get = async (path: string) => {
    const res = await operatorConsole(
      new Request(`http://api${path}`, { headers: { authorization: `Bearer ${TOKEN}` } }),
      new URL(`http://api${path}`).pathname,
    );
    return { status: res.status, body: await res.text() };
  };
  try {
    await createApiKey(db.sql, "acme");
    for (const c of calls) {
      await recordAttempt(db.sql, {
        runId: crypto.randomUUID(),
        tenant: "acme",
        startedAt: new Date(c.at),
        promptTokens: c.prompt,
        completionTokens: 0,
        costUsd: (c.prompt / 1e6).toFixed(6),
      });
    }
    // Another tenant's call, in every window: not on acme's page.
    await recordAttempt(db.sql, {
      runId: crypto.randomUUID(),
      tenant: "a&b c",
      startedAt: new Date(NOW - 1_000),
      promptTokens: 1_000,
    });
    // 429s 10 minutes and 2, 20 and 30 hours ago: Redis keeps each UTC hour 25 hours, so the last is lost.
    for (const ago of [10 * MINUTE, 2 * HOUR, 20 * HOUR, 30 * HOUR]) {
      await recordRefusal(r.redis, keys, "acme", 429, NOW - ago);
    }

    /** Per bucket of `window`: the prompt tokens of acme's calls in it. */
    const perBucket = (w: { fromMs: number; widthMs: number; count: number }) =>
      Array.from({ length: w.count }, (_, i) => {
        const start = w.fromMs + i * w.widthMs;
        return calls.filter((c) => c.at >= start && c.at < start + w.widthMs).reduce((s, c) => s + c.prompt, 0);
      });
    /** At each bucket's end: acme's tokens since midnight (UTC) of the day the bucket is in. */
    const daySoFar = (w: { fromMs: number; widthMs: number; count: number }) =>
      Array.from({ length: w.count }, (_, i) => {
        const start = w.fromMs + i * w.widthMs, midnight = Math.floor(start / DAY) * DAY;
        return calls.filter((c) => c.at >= midnight && c.at < start + w.widthMs).reduce((s, c) => s + c.prompt, 0);
      });
    const expected = {
      "1h": {
        fromMs: at("2026-12-03T13:38:00"),
        widthMs: MINUTE,
        count: 60,
        unit: "minute",
        labels: Array.from({ length: 12 }, (_, i) => new Date(at("2026-12-03T13:40:00") + i * 5 * MINUTE))
          .map((d) => d.toISOString().slice(11, 16)),
        days: 1,
        refused: "1",
      },
      "24h": {
        fromMs: at("2026-12-02T15:00:00"),
        widthMs: HOUR,
        count: 24,
        unit: "hour",
        labels: ["16", "18", "20", "22", "00", "02", "04", "06", "08", "10", "12", "14"].map((h) => `${h}:00`),
        days: 2,
        refused: "3",
      },
      "7d": {
        fromMs: at("2026-11-26T18:00:00"),
        widthMs: 6 * HOUR,
        count: 28,
        unit: "6 hours",
        labels: ["11-27", "11-28", "11-29", "11-30", "12-01", "12-02", "12-03"].map((d) => `${d} 00:00`),
        days: 8,
        refused: "3 (since 2026-12-02 18:00 UTC; older 429s are not kept)",
      },
    };

    for (const [name, w] of Object.entries(expected)) {
      await t.step(`${name}: ${w.count} buckets per ${w.unit} on the clock, labelled, and their figures`, async () => {
        const { status, body } = await get(`/console/usage?tenant=acme&window=${name}`);
        assert.equal(status, 200);
        const bars = marksOf(body, "usage-calls").get("calls")!.map((m) => Date.parse(m.bucket));
        assert.equal(bars.length, w.count);
        bars.forEach((start, i) => assert.equal(start, w.fromMs + i * w.widthMs, `bucket ${i}`));
        assert.ok(bars.at(-1)! <= NOW && NOW < bars.at(-1)! + w.widthMs, "the last bucket holds now");
        for (const id of ["usage-calls", "usage-tokens", "usage-spend", "usage-cache"]) {
          assert.deepEqual(axisLabels(body, id), w.labels, `${id}'s axis`);
        }
        // Every title, description and axis names the bucket.
        assert.match(body, new RegExp(`<title id="usage-calls-title">Model calls and 429s per ${w.unit}</title>`));
        assert.match(body, new RegExp(`<title id="usage-tokens-title">Tokens per ${w.unit}, against the daily budget`));
        assert.match(body, new RegExp(`<title id="usage-spend-title">Spend per ${w.unit} \\(USD\\)`));
        assert.match(body, new RegExp(`<title id="usage-cache-title">Cache hits per ${w.unit}</title>`));
        assert.match(
          body,
          new RegExp(
            `<desc id="usage-calls-desc">Model calls \\(model_attempts rows\\) and ` +
              `requests answered 429 per ${w.unit} over`,
          ),
        );
        assert.equal(svgOf(body, "usage-calls").match(new RegExp(`>per ${w.unit}</text>`, "g"))?.length, 1, "y axis");
        assert.match(svgOf(body, "usage-tokens"), new RegExp(`\\(bars: per ${w.unit}; line: the day so far`));

        const prompt = perBucket(w);
        assert.deepEqual(valuesOf(body, "usage-tokens", "prompt"), prompt);
        const ones = (n: number) => n.toString(2).split("1").length - 1;
        assert.deepEqual(valuesOf(body, "usage-calls", "calls"), prompt.map(ones));
        assert.equal(figureOf(body, "total-prompt"), String(prompt.reduce((a, b) => a + b, 0)));
        assert.deepEqual(valuesOf(body, "usage-tokens", "tokens-today"), daySoFar(w));
        const line = /<path d="([^"]+)"/.exec(svgOf(body, "usage-tokens"))![1]!;
        assert.equal(line.split("M").length - 1, w.days, "the day so far starts afresh at each UTC midnight");
        assert.equal(figureOf(body, "total-refused"), w.refused);
      });
    }

    await t.step("the 7 days' 429s: none for the buckets before the oldest hour Redis still keeps", async () => {
      const { body } = await get("/console/usage?tenant=acme&window=7d");
      const refused = valuesOf(body, "usage-calls", "refused");
      assert.deepEqual(
        refused.slice(0, 24),
        Array(24).fill(null),
        "from 2026-12-02 14:00 on: 18:00 is the first whole",
      );
      assert.deepEqual(refused.slice(24), [1, 0, 0, 2]);
      assert.match(body, /429s are kept 25 hours: the buckets before show none\./);
      const day = await get("/console/usage?tenant=acme&window=24h");
      assert.ok(!valuesOf(day.body, "usage-calls", "refused").includes(null), "24 hours are kept whole");
    });

    await t.step("the default is 24 hours; the links switch the window and keep the tenant", async () => {
      const plain = await get("/console/usage?tenant=acme");
      assert.equal(valuesOf(plain.body, "usage-calls", "calls").length, 24);
      assert.match(plain.body, /<strong>24 hours, per hour<\/strong>/);
      const { body } = await get(`/console/usage?tenant=${encodeURIComponent("a&b c")}&window=7d`);
      const links = [...body.matchAll(/<a href="([^"]+)" data-window="([^"]+)">/g)].map((m) => [m[2], m[1]]);
      assert.deepEqual(links, [
        ["1h", "/console/usage?tenant=a%26b+c&amp;window=1h"],
        ["24h", "/console/usage?tenant=a%26b+c&amp;window=24h"],
      ]);
      assert.match(body, /<strong>7 days, per 6 hours<\/strong>/, "the window shown is not a link");
      assert.match(body, /<input type="hidden" name="window" value="7d">/, "the tenant selector keeps the window");
      assert.equal(figureOf(body, "total-prompt"), "1,000", "that tenant's figures");
      const all = await get("/console/usage?window=1h");
      assert.deepEqual([...all.body.matchAll(/data-window="([^"]+)"/g)].map((m) => m[1]), ["24h", "7d"]);
      assert.match(all.body, /<a href="\/console\/usage\?window=24h" data-window="24h">/, "all tenants: no tenant");
    });

    await t.step("an unknown window is a 400 naming it, with the links to the windows there are", async () => {
      for (const name of ["2h", "24H", "<b>7d</b>"]) {
        const { status, body } = await get(`/console/usage?tenant=acme&window=${encodeURIComponent(name)}`);
        assert.equal(status, 400, name);
        assert.ok(body.includes(`Not a window: <code>${name.replaceAll("<", "&lt;").replaceAll(">", "&gt;")}</code>`));
        assert.deepEqual([...body.matchAll(/<a href="([^"]+)" data-window=/g)].map((m) => m[1]), [
          "/console/usage?tenant=acme&amp;window=1h",
          "/console/usage?tenant=acme&amp;window=24h",
          "/console/usage?tenant=acme&amp;window=7d",
        ]);
        assert.ok(!body.includes("<svg"), "no chart");
      }
    });
  } finally {
    await r.close();
    await db.close();
  }
});
