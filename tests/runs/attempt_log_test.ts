/**
 * The attempt log writes many tenants' calls in one statement: a row that
 * Postgres refuses, or a count an `integer` cannot hold, must cost that row
 * at most, never the rest of its batch.
 */
import assert from "node:assert/strict";
import type { AttemptRow } from "../../src/jobs/job_store.ts";
import { createLogger } from "../../src/log/logger.ts";
import { createAttemptLog } from "../../src/runs/attempt_log.ts";
import { createTestDatabase, recordingLogger } from "../_support.ts";

/** One successful call of `summarize` v1; `over` changes any field, to a value of any type. */
function row(tenant: string, over: Record<string, unknown> = {}): AttemptRow {
  return {
    job_id: crypto.randomUUID(),
    tenant,
    delivery: 1,
    attempt: 1,
    started_at: new Date(),
    duration_ms: 120,
    outcome: "ok",
    status: 200,
    prompt_tokens: 11,
    completion_tokens: 7,
    provider_request_id: `req_${crypto.randomUUID()}`,
    model: "m",
    error: null,
    task: "summarize",
    version: 1,
    cost_usd: null,
    deployment: "m",
    ...over,
  } as AttemptRow;
}

Deno.test("a batch of attempts with rows Postgres refuses keeps every other row", async () => {
  const db = await createTestDatabase();
  const logged = recordingLogger();
  // Written only when flushed: every row below is one batch, one statement.
  const log = createAttemptLog({ sql: db.sql, log: createLogger({ write: logged.write }) }, { everyMs: 60_000 });
  try {
    const good = ["acme", "globex", "initech", "umbrella", "hooli"].map((tenant) => row(tenant));
    // Counts an integer column cannot hold: stored as unknown (NULL), not refused.
    const odd = [
      row("odd-huge", { prompt_tokens: 1e15 }),
      row("odd-fraction", { completion_tokens: 0.5 }),
      row("odd-negative", { prompt_tokens: -3 }),
      row("odd-string", { prompt_tokens: "12", status: "200" }),
    ];
    // Values Postgres refuses outright: a NUL in text (22021), a NULL where NOT NULL (23502), an invalid date.
    const refused = [
      row("bad-nul", { provider_request_id: "req_\u0000" }),
      row("bad-null", { model: null }),
      row("bad-date", { started_at: new Date(Number.NaN) }),
    ];
    for (const r of [good[0]!, ...refused.slice(0, 2), ...good.slice(1, 3), ...odd, refused[2]!, ...good.slice(3)]) {
      log.record(r);
    }
    await log.flush();

    const rows = await db.sql<{ tenant: string; prompt_tokens: number | null; completion_tokens: number | null }[]>`
      SELECT tenant, prompt_tokens, completion_tokens, status FROM model_attempts ORDER BY tenant`;
    const byTenant = new Map(rows.map((r) => [r.tenant, r]));
    for (const r of good) {
      assert.deepEqual(byTenant.get(r.tenant), {
        tenant: r.tenant,
        prompt_tokens: 11,
        completion_tokens: 7,
        status: 200,
      });
    }
    assert.deepEqual(byTenant.get("odd-huge"), {
      tenant: "odd-huge",
      prompt_tokens: null,
      completion_tokens: 7,
      status: 200,
    });
    assert.deepEqual(byTenant.get("odd-fraction"), {
      tenant: "odd-fraction",
      prompt_tokens: 11,
      completion_tokens: null,
      status: 200,
    });
    assert.deepEqual(byTenant.get("odd-negative"), {
      tenant: "odd-negative",
      prompt_tokens: null,
      completion_tokens: 7,
      status: 200,
    });
    assert.deepEqual(byTenant.get("odd-string"), {
      tenant: "odd-string",
      prompt_tokens: null,
      completion_tokens: 7,
      status: null,
    });
    assert.equal(rows.length, good.length + odd.length, JSON.stringify(rows));

    // Each refused row is dropped alone, and named.
    const dropped = logged.lines.filter((l) => l.event === "model_attempt_dropped").map((l) => l.tenant).sort();
    assert.deepEqual(dropped, ["bad-date", "bad-nul", "bad-null"]);
    assert.equal(logged.lines.filter((l) => l.event === "model_attempts_write_failed").length, 0);
  } finally {
    await log.close();
    await db.close();
  }
});

Deno.test("a batch refused for anything but its values is dropped whole, with one line", async () => {
  const db = await createTestDatabase();
  const logged = recordingLogger();
  const log = createAttemptLog({ sql: db.sql, log: createLogger({ write: logged.write }) }, { everyMs: 60_000 });
  try {
    await db.sql`ALTER TABLE model_attempts RENAME TO model_attempts_away`;
    for (const tenant of ["acme", "globex", "initech"]) log.record(row(tenant));
    await log.flush();
    // Not about the values (undefined table, 42P01): no halving, one line for the batch.
    const failed = logged.lines.filter((l) => l.event === "model_attempts_write_failed");
    assert.deepEqual(failed.map((l) => l.rows), [3]);
    assert.equal(logged.lines.filter((l) => l.event === "model_attempt_dropped").length, 0);
  } finally {
    await log.close();
    await db.close();
  }
});
