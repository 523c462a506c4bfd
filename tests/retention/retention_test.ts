import assert from "node:assert/strict";
import { insertAttempts } from "../../src/jobs/job_store.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { createRetention, type RetentionOptions } from "../../src/retention/retention.ts";
import { OUTCOME_MIN_AGE_MS } from "../../src/processes/relay_process.ts";
import { commitResults } from "../../src/runs/commit.ts";
import postgres from "postgres";
import { createTestDatabase, waitFor } from "../_support.ts";

const DAY_MS = 24 * 3600 * 1000;

Deno.test("retention", async (t) => {
  const db = await createTestDatabase();
  const sql = db.sql;
  /** Commits `n` summaries for tenant acme, each with its email's outbox row; @returns their job ids. */
  const addJobs = async (n: number) => {
    const ids = Array.from({ length: n }, () => crypto.randomUUID());
    await commitResults(
      sql,
      ids.map((jobId) => ({ jobId, tenant: "acme", summary: `Summary of ${jobId}.`, notify: "ops@example.com" })),
    );
    return ids;
  };
  const count = async (table: string) =>
    (await sql<{ n: number }[]>`SELECT count(*)::int AS n FROM ${sql(table)}`)[0]!.n;
  /** A retention service whose DELETE statements are recorded: [table, rows deleted] each. */
  const retentionWith = (options: Partial<RetentionOptions>) => {
    const batches: [string, number][] = [];
    const retention = createRetention({ sql, log: silentLogger }, {
      outcomeMinAgeMs: OUTCOME_MIN_AGE_MS,
      pauseMs: 0,
      ...options,
      onBatch: (table, rows) => batches.push([table, rows]),
    });
    return { retention, batches };
  };
  const reset = () => sql`TRUNCATE summaries, outbox, job_outcomes, model_attempts`;

  try {
    await t.step("runOnce deletes in batches until a batch deletes fewer than the batch size", async () => {
      await reset();
      await addJobs(5);
      await sql`UPDATE outbox SET sent_at = now() - interval '10 days'`;
      const { retention, batches } = retentionWith({ batch: 2, outboxRetentionMs: 7 * DAY_MS });
      assert.equal(await retention.runOnce(), 5);
      assert.deepEqual(batches, [["outbox", 2], ["outbox", 2], ["outbox", 1]]);
      assert.equal(await count("outbox"), 0);

      // A multiple of the batch size ends with an empty batch.
      await addJobs(4);
      await sql`UPDATE outbox SET sent_at = now() - interval '10 days'`;
      batches.length = 0;
      assert.equal(await retention.runOnce(), 4);
      assert.deepEqual(batches, [["outbox", 2], ["outbox", 2], ["outbox", 0]]);
    });

    await t.step("unsent and failed rows stay, and so do their summaries; sent ones go", async () => {
      await reset();
      const [sent, pending, failed, recent] = await addJobs(4);
      const key = (jobId: string | undefined) => `summary_ready:${jobId}`;
      await sql`UPDATE summaries SET created_at = now() - interval '40 days' WHERE job_id <> ${recent!}::uuid`;
      await sql`UPDATE outbox SET created_at = now() - interval '40 days'`;
      await sql`UPDATE outbox SET sent_at = now() - interval '10 days' WHERE dedupe_key = ${key(sent)}`;
      await sql`UPDATE outbox SET failed_at = now() - interval '10 days' WHERE dedupe_key = ${key(failed)}`;
      await sql`UPDATE outbox SET sent_at = now() WHERE dedupe_key = ${key(recent)}`;
      const { retention, batches } = retentionWith({
        batch: 1,
        outboxRetentionMs: 7 * DAY_MS,
        summaryRetentionMs: 30 * DAY_MS,
      });
      // The sent row, then the sent job's summary; no task run results; the outcome stays (it is younger than
      // OUTCOME_MIN_AGE_MS).
      assert.equal(await retention.runOnce(), 2);
      assert.deepEqual(batches, [
        ["outbox", 1],
        ["outbox", 0],
        ["summaries", 1],
        ["summaries", 0],
        ["run_results", 0],
        ["job_outcomes", 0],
      ]);
      const outbox = await sql<{ dedupe_key: string }[]>`SELECT dedupe_key FROM outbox`;
      assert.deepEqual(outbox.map((r) => r.dedupe_key).sort(), [key(pending), key(failed), key(recent)].sort());
      const summaries = await sql<{ job_id: string }[]>`SELECT job_id::text FROM summaries`;
      assert.deepEqual(summaries.map((r) => r.job_id).sort(), [pending!, failed!, recent!].sort());
      assert.equal(await count("job_outcomes"), 4);

      // Past OUTCOME_MIN_AGE_MS (and SUMMARY_RETENTION_S), the outcome of the job without a summary goes too.
      await sql`UPDATE job_outcomes SET decided_at = now() - ${
        OUTCOME_MIN_AGE_MS + 31 * DAY_MS
      } * interval '1 millisecond'`;
      assert.equal(await retention.runOnce(), 1);
      const outcomes = await sql<{ job_id: string }[]>`SELECT job_id::text FROM job_outcomes`;
      assert.deepEqual(outcomes.map((r) => r.job_id).sort(), [pending!, failed!, recent!].sort());
    });

    await t.step("without SUMMARY_RETENTION_S, summaries and outcomes are kept", async () => {
      await reset();
      await addJobs(2);
      await sql`UPDATE summaries SET created_at = now() - interval '400 days'`;
      await sql`UPDATE job_outcomes SET decided_at = now() - interval '400 days'`;
      await sql`UPDATE outbox SET sent_at = now() - interval '400 days'`;
      const { retention } = retentionWith({});
      assert.equal(await retention.runOnce(), 2, "only the sent rows");
      assert.equal(await count("summaries"), 2);
      assert.equal(await count("job_outcomes"), 2);
    });

    await t.step("model attempts older than MODEL_ATTEMPTS_RETENTION_S are deleted, in batches", async () => {
      await reset();
      const attempt = (startedAt: Date) => ({
        job_id: crypto.randomUUID(),
        tenant: "acme",
        delivery: 1,
        attempt: 1,
        started_at: startedAt,
        duration_ms: 10,
        outcome: "ok",
        status: 200,
        prompt_tokens: 1,
        completion_tokens: 1,
        provider_request_id: null,
        model: "extractive",
        error: null,
        task: "summarize",
        version: 1,
        cost_usd: null,
        deployment: "extractive",
      });
      const old = new Date(Date.now() - 31 * DAY_MS);
      await insertAttempts(sql, [attempt(old), attempt(old), attempt(old), attempt(new Date())]);
      const { retention, batches } = retentionWith({ batch: 2, attemptRetentionMs: 30 * DAY_MS });
      assert.equal(await retention.runOnce(), 3);
      assert.deepEqual(batches.filter(([table]) => table === "model_attempts"), [
        ["model_attempts", 2],
        ["model_attempts", 1],
      ]);
      assert.equal(await count("model_attempts"), 1);
      // Unset, the record is kept.
      await sql`UPDATE model_attempts SET started_at = now() - interval '400 days'`;
      assert.equal(await retentionWith({}).retention.runOnce(), 0);
    });

    await t.step("start() runs passes on its interval; stop() waits for the one in progress", async () => {
      await reset();
      await addJobs(3);
      await sql`UPDATE outbox SET sent_at = now() - interval '10 days'`;
      const { retention, batches } = retentionWith({ firstPassAfterMs: 0, everyMs: 20 });
      retention.start();
      const deadline = Date.now() + 5_000;
      while (batches.length < 2 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 10));
      await retention.stop();
      assert.ok(batches.length >= 2, "at least two passes ran");
      assert.equal(await count("outbox"), 0);
      const seen = batches.length;
      await new Promise((r) => setTimeout(r, 60));
      assert.equal(batches.length, seen, "no pass after stop()");
    });

    await t.step("two replicas: one pass at a time, the other skips; a pass pauses between full batches", async () => {
      await reset();
      await addJobs(6);
      await sql`UPDATE outbox SET sent_at = now() - interval '10 days'`;
      // Two relay replicas on one database, as two processes would run them (each reserves its own connection).
      const a = retentionWith({ batch: 2, pauseMs: 200 });
      const b = retentionWith({ batch: 2, pauseMs: 0 });
      const started = performance.now();
      const passA = a.retention.runOnce();
      await waitFor("A's first batch", () => a.batches.length >= 1);
      // A pauses between its batches, holding the pass: B's pass is skipped, not run beside it.
      assert.equal(await b.retention.runOnce(), 0);
      assert.deepEqual(b.batches, [], "B deleted nothing and ran no statement");
      assert.equal(await passA, 6);
      assert.deepEqual(a.batches, [["outbox", 2], ["outbox", 2], ["outbox", 2], ["outbox", 0]]);
      // Three full batches, three pauses of 100-300 ms each.
      assert.ok(performance.now() - started >= 300, "A paused after each full batch");
      // A's pass over, the lock is free: B's next pass runs.
      assert.equal(await b.retention.runOnce(), 0);
      assert.deepEqual(b.batches, [["outbox", 0]]);
    });

    await t.step("a replica that dies mid-pass frees the pass with its connection", async () => {
      await reset();
      const other = postgres(db.url, { max: 1, onnotice: () => {} });
      try {
        // Held as a pass holds it, then the process is gone: its connection closes.
        await other`SELECT pg_advisory_lock(hashtextextended('oncely/retention', 0))`;
        await addJobs(1);
        await sql`UPDATE outbox SET sent_at = now() - interval '10 days'`;
        const { retention } = retentionWith({});
        assert.equal(await retention.runOnce(), 0, "held by the other replica");
        await other.end();
        assert.equal(await retention.runOnce(), 1);
      } finally {
        await other.end();
      }
    });

    await t.step("stop() ends a pause at once", async () => {
      await reset();
      await addJobs(4);
      await sql`UPDATE outbox SET sent_at = now() - interval '10 days'`;
      const { retention, batches } = retentionWith({ batch: 2, pauseMs: 60_000, firstPassAfterMs: 0 });
      retention.start();
      await waitFor("the first batch", () => batches.length >= 1);
      const stopping = performance.now();
      await retention.stop();
      assert.ok(performance.now() - stopping < 5_000, "not the minute's pause");
      assert.deepEqual(batches, [["outbox", 2]], "no batch after stop()");
    });
  } finally {
    await db.close();
  }
});
