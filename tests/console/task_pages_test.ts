/**
 * The console's task pages read columns, and only the definitions they
 * show, bounded in bytes (each definition may be hundreds of KB), over a
 * real Postgres. A task's page shows the usage of that task alone (its
 * model calls, tokens, cost and cache hits) over the window chosen, against
 * rows written at known instants beside other tasks' and tenants'.
 */
import assert from "node:assert/strict";
import { DEFINITION_BYTES_SHOWN, taskPage, tasksPage } from "../../src/console/task_pages.ts";
import type { PageDeps } from "../../src/console/pages.ts";
import { putTaskVersion } from "../../src/jobs/task_store.ts";
import { createTestDatabase } from "../_support.ts";
import { figureOf, valuesOf } from "../support/chart_marks.ts";
import { recordAttempt, recordCacheHit } from "../support/run_rows.ts";
import { smallDefinition } from "../support/task_definitions.ts";

Deno.test("a task's page shows the newest definitions within 1 MiB, and every version's size", async () => {
  const db = await createTestDatabase();
  // The task pages read Postgres alone.
  const deps = { sql: db.sql } as unknown as PageDeps;
  const view = { csrf: "csrf" };
  try {
    // Six versions of about 300 KB (as a release before the 256 KiB bound could store them).
    for (let v = 1; v <= 6; v++) {
      const definition = { ...smallDefinition(v), system: "s".repeat(300_000) };
      await db.sql`INSERT INTO tasks (tenant, name, version, definition)
        VALUES ('acme', 'big', ${v}, ${db.sql.json(definition as never)})`;
    }
    const body = await (await taskPage(deps, view, "acme", "big")).text();
    const shown = [...body.matchAll(/<h2 id="v(\d+)">/g)].map((m) => Number(m[1]));
    assert.deepEqual(shown, [6, 5, 4], `at most ${DEFINITION_BYTES_SHOWN} bytes of definitions`);
    assert.match(body, /The 3 newest definitions are shown/);
    const sizes = [...body.matchAll(/<td>(\d{6})<\/td>/g)].map((m) => Number(m[1]));
    assert.equal(sizes.length, 6, "every version's size");
    assert.ok(sizes.every((n) => n > 300_000 && n < 301_000), String(sizes));
    // One version alone, however large.
    const one = await (await taskPage(deps, view, "acme", "big", { version: "1" })).text();
    assert.deepEqual([...one.matchAll(/<h2 id="v(\d+)">/g)].map((m) => Number(m[1])), [1]);

    const list = await (await tasksPage(deps, view)).text();
    assert.match(list, /1 task\(s\)/);
    assert.match(list, /<td>6<\/td>/, "its versions");
    assert.ok(list.length < 20_000, "no definition on the list");
  } finally {
    await db.close();
  }
});

Deno.test("a task's page shows its own calls, tokens, spend and cache hits over the window chosen", async (t) => {
  const db = await createTestDatabase();
  // Thursday 2026-12-03, 14:37:25.500 UTC.
  const NOW = Date.UTC(2026, 11, 3, 14, 37, 25, 500);
  const deps = { sql: db.sql, now: () => NOW } as unknown as PageDeps;
  const view = { csrf: "csrf" };
  const at = (iso: string) => new Date(`${iso}Z`);
  try {
    await putTaskVersion(db.sql, "acme", "triage", smallDefinition(1));
    await putTaskVersion(db.sql, "acme", "triage", smallDefinition(2));
    const call = (
      tenant: string,
      task: string,
      version: number,
      startedAt: Date,
      tokens: [number, number],
      cost?: string,
    ) =>
      recordAttempt(db.sql, {
        runId: crypto.randomUUID(),
        tenant,
        task,
        version,
        startedAt,
        promptTokens: tokens[0],
        completionTokens: tokens[1],
        costUsd: cost,
      });
    // triage's calls, both versions: three in the last hour (one unpriced), one more today, one more this week.
    await call("acme", "triage", 1, at("2026-12-03T14:05:00"), [100, 20], "0.0001");
    await call("acme", "triage", 2, at("2026-12-03T14:20:00"), [200, 30], "0.0002");
    await call("acme", "triage", 2, at("2026-12-03T14:36:59.999"), [50, 5]);
    await call("acme", "triage", 2, at("2026-12-03T09:15:00"), [300, 40], "0.0003");
    await call("acme", "triage", 1, at("2026-11-30T10:00:00"), [400, 50], "0.0004");
    await call("acme", "triage", 1, at("2026-11-20T10:00:00"), [5_000, 500], "0.005"); // before every window
    // Not triage's: another task of acme, and another tenant's task of the same name.
    await call("acme", "extract", 1, at("2026-12-03T14:10:00"), [7_000, 700], "0.07");
    await call("globex", "triage", 1, at("2026-12-03T14:10:00"), [9_000, 900], "0.09");
    await recordCacheHit(db.sql, {
      runId: crypto.randomUUID(),
      tenant: "acme",
      task: "triage",
      version: 2,
      savedPromptTokens: 120,
      savedCompletionTokens: 30,
      savedUsd: "0.00018",
      createdAt: at("2026-12-03T14:30:00"),
    });
    await recordCacheHit(db.sql, {
      runId: crypto.randomUUID(),
      tenant: "acme",
      task: "extract",
      createdAt: at("2026-12-03T14:30:00"),
    });

    const expected = {
      "1h": { calls: "3", prompt: "350", completion: "55", cost: "$0.0003 (1 calls unpriced)", buckets: 60 },
      "24h": { calls: "4", prompt: "650", completion: "95", cost: "$0.0006 (1 calls unpriced)", buckets: 24 },
      "7d": { calls: "5", prompt: "1,050", completion: "145", cost: "$0.001 (1 calls unpriced)", buckets: 28 },
    };
    for (const [window, e] of Object.entries(expected)) {
      await t.step(`${window}: triage's figures alone, per bucket and in total`, async () => {
        const res = await taskPage(deps, view, "acme", "triage", { window });
        assert.equal(res.status, 200);
        const body = await res.text();
        assert.equal(figureOf(body, "total-calls"), e.calls);
        assert.equal(figureOf(body, "total-prompt"), e.prompt);
        assert.equal(figureOf(body, "total-completion"), e.completion);
        assert.equal(figureOf(body, "total-cost"), e.cost);
        assert.equal(figureOf(body, "total-hits"), "1");
        assert.equal(figureOf(body, "total-saved"), "150 tokens, $0.00018");
        const calls = valuesOf(body, "usage-calls", "calls");
        assert.equal(calls.length, e.buckets);
        assert.equal(calls.reduce((a, b) => a! + b!, 0), Number(e.calls));
        assert.ok(
          !body.includes(`data-series="refused"`) && !body.includes("data-limit="),
          "429s and budgets: tenant's",
        );
        assert.ok(!body.includes(`data-series="tokens-today"`), "no day so far: the budgets are the tenant's");
        assert.match(
          body,
          new RegExp(`<a href="/console/usage\\?tenant=acme&amp;window=${window}">its usage page</a>`),
        );
      });
    }

    await t.step("1h: each call in its minute, the spend of each", async () => {
      const body = await (await taskPage(deps, view, "acme", "triage", { window: "1h" })).text();
      // The hour's buckets start at 13:38: 14:05 is the 28th, 14:20 the 43rd, 14:36 the 59th.
      const calls = valuesOf(body, "usage-calls", "calls");
      assert.deepEqual(calls.flatMap((v, i) => (v ? [[i, v]] : [])), [[27, 1], [42, 1], [58, 1]]);
      const prompt = valuesOf(body, "usage-tokens", "prompt"), spend = valuesOf(body, "usage-spend", "spend");
      assert.deepEqual([prompt[27], prompt[42], prompt[58]], [100, 200, 50]);
      assert.deepEqual([spend[27], spend[42], spend[58]], [0.0001, 0.0002, 0]);
      assert.deepEqual(valuesOf(body, "usage-cache", "hits").flatMap((v, i) => (v ? [i] : [])), [52]);
      assert.match(body, /<title id="usage-calls-title">Model calls per minute<\/title>/);
    });

    await t.step("the links switch the window and keep the version; an unknown window is a 400", async () => {
      const body = await (await taskPage(deps, view, "acme", "triage", { version: "2", window: "7d" })).text();
      assert.deepEqual([...body.matchAll(/<a href="([^"]+)" data-window=/g)].map((m) => m[1]), [
        "/console/tasks/acme/triage?version=2&amp;window=1h",
        "/console/tasks/acme/triage?version=2&amp;window=24h",
      ]);
      assert.match(body, /<strong>7 days, per 6 hours<\/strong>/);
      assert.equal(figureOf(body, "total-calls"), "5", "all versions' calls, whichever version is shown");
      const bad = await taskPage(deps, view, "acme", "triage", { window: "30d" });
      assert.equal(bad.status, 400);
      const text = await bad.text();
      assert.ok(text.includes("Not a window: <code>30d</code>"));
      assert.match(text, /<a href="\/console\/tasks\/acme\/triage\?window=1h" data-window="1h">/);
      const none = await taskPage(deps, view, "acme", "nope", { window: "1h" });
      assert.equal(none.status, 404, "no task, no usage");
      await none.body?.cancel();
    });
  } finally {
    await db.close();
  }
});
