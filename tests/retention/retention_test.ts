import assert from "node:assert/strict";
import { insertAttempts } from "../../src/jobs/job_store.ts";
import { createLogger, type Logger, silentLogger } from "../../src/log/logger.ts";
import { createRetention, type Retention, type RetentionOptions } from "../../src/retention/retention.ts";
import { OUTCOME_MIN_AGE_MS } from "../../src/processes/relay_process.ts";
import { commitResults } from "../../src/runs/commit.ts";
import postgres, { type Sql } from "postgres";
import { createTestDatabase, recordingLogger, waitFor } from "../_support.ts";

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
  /**
   * A retention service whose DELETE statements are recorded: [table, rows deleted] each. It runs on the test's
   * pool unless given `sql` (a relay's one-connection client), and logs nowhere unless given `log`.
   */
  const retentionWith = (
    { sql: client = sql, log = silentLogger, ...options }: Partial<RetentionOptions> & { sql?: Sql; log?: Logger },
  ) => {
    const batches: [string, number][] = [];
    const retention = createRetention({ sql: client, log }, {
      outcomeMinAgeMs: OUTCOME_MIN_AGE_MS,
      pauseMs: 0,
      onBatch: (table, rows) => batches.push([table, rows]),
      ...options,
    });
    return { retention, batches };
  };
  /** A client of one connection, as the relay process gives retention. */
  const oneConnection = () => postgres(db.url, { max: 1, onnotice: () => {} });
  const backendPid = async (client: Sql) => (await client<{ pid: number }[]>`SELECT pg_backend_pid() AS pid`)[0]!.pid;
  /** The backends holding retention's pass lock on this database. */
  const lockHolders = async () =>
    (await sql<{ pid: number }[]>`
      SELECT pid FROM pg_locks
      WHERE locktype = 'advisory' AND granted AND objsubid = 1
        AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
        AND ((classid::bigint << 32) | objid::bigint) = hashtextextended('oncely/retention', 0)`).map((r) => r.pid);
  /** A `sleep` for retention's pauses that holds each pause until `release()` (from then on, none), or the stop. */
  const heldPauses = () => {
    let pauses = 0;
    let held = true;
    const waiting = new Set<() => void>();
    return {
      count: () => pauses,
      sleep(_ms: number, signal: AbortSignal) {
        pauses++;
        if (!held) return Promise.resolve();
        return new Promise<void>((resolve) => {
          const done = () => {
            waiting.delete(done);
            signal.removeEventListener("abort", done);
            resolve();
          };
          waiting.add(done);
          signal.addEventListener("abort", done, { once: true });
        });
      },
      release() {
        held = false;
        for (const done of [...waiting]) done();
      },
    };
  };
  const reset = () => sql`TRUNCATE summaries, outbox, job_outcomes, model_attempts`;
  /** Starts over with `n` jobs whose emails were sent 10 days ago. */
  const resetWithSentRows = async (n: number) => {
    await reset();
    await addJobs(n);
    await sql`UPDATE outbox SET sent_at = now() - interval '10 days'`;
  };
  /**
   * Two relays' retention on one database, each on a connection of its own as `startRetention` opens it, in
   * batches of 2: A pauses 100 ms between batches, each pause held (`paused`); B does not pause.
   */
  const twoRelays = (optionsB: Partial<RetentionOptions> & { log?: Logger } = {}) => {
    const [clientA, clientB] = [oneConnection(), oneConnection()];
    const paused = heldPauses();
    const a = retentionWith({ sql: clientA, batch: 2, pauseMs: 100, sleep: paused.sleep, firstPassAfterMs: 0 });
    const b = retentionWith({ sql: clientB, batch: 2, pauseMs: 0, ...optionsB });
    return {
      a,
      b,
      clientA,
      paused,
      async close() {
        paused.release();
        await a.retention.stop();
        await b.retention.stop();
        await clientA.end();
        await clientB.end();
      },
    };
  };

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

    await t.step(
      "the tenant change log's rows of transactions ended tenantChangesRetentionMs ago go, in batches",
      async () => {
        await reset();
        for (
          const name of ["a", "b", "c"]
        ) await sql`INSERT INTO tenants (name) VALUES (${name}) ON CONFLICT DO NOTHING`;
        const old = async () =>
          (await sql<{ n: number }[]>`
          SELECT count(*)::int AS n FROM tenant_changes WHERE xid < (
            SELECT max(oldest_running) FROM tenant_change_horizons WHERE at < now() - interval '1 hour')`)[0]!.n;
        // What a pass two hours ago recorded (a transaction open elsewhere on the server holds it back until it ends).
        await waitFor("a horizon above the three tenants' rows", async () => {
          await sql`
          INSERT INTO tenant_change_horizons (at, oldest_running) VALUES
            (now() - interval '2 hours' + random() * interval '1 second', pg_snapshot_xmin(pg_current_snapshot()))`;
          return (await old()) === 3;
        });
        await sql`INSERT INTO tenant_changes (tenant) VALUES ('d')`;
        assert.equal(await retentionWith({}).retention.runOnce(), 0, "unset, the log is kept");
        const { retention, batches } = retentionWith({ batch: 2, tenantChangesRetentionMs: 3_600_000 });
        assert.equal(await retention.runOnce(), 3);
        assert.deepEqual(batches.filter(([table]) => table === "tenant_changes"), [
          ["tenant_changes", 2],
          ["tenant_changes", 1],
        ]);
        assert.deepEqual((await sql`SELECT tenant FROM tenant_changes`).map((r) => r.tenant), ["d"]);
      },
    );

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

    await t.step("a pass pauses after each full batch, jittered, and holds its lock through the pauses", async () => {
      await resetWithSentRows(5);
      const events: string[] = [];
      const jitter = [0, 0.999];
      let retention: Retention | undefined;
      const client = oneConnection();
      try {
        ({ retention } = retentionWith({
          sql: client,
          batch: 2,
          pauseMs: 100,
          random: () => jitter.shift()!,
          async sleep(ms) {
            events.push(`pause ${ms.toFixed(1)}`);
            // Mid-pass, the lock is held by this pass's session alone, and this replica's own next pass skips.
            assert.deepEqual(await lockHolders(), [await backendPid(client)]);
            assert.equal(await retention!.runOnce(), 0, "a second pass of the same replica skips");
          },
          onBatch: (table, rows) => events.push(`${table} ${rows}`),
        }));
        assert.equal(await retention.runOnce(), 5);
        // 100 ms from half to one and a half times; no pause after the batch that ended the table.
        assert.deepEqual(events, ["outbox 2", "pause 50.0", "outbox 2", "pause 149.9", "outbox 1"]);
        assert.deepEqual(await lockHolders(), [], "the pass released its lock");
      } finally {
        await client.end();
      }
    });

    await t.step(
      "two relays on one database: one runs a pass, the other skips it and takes over when the first stops",
      async () => {
        await resetWithSentRows(6);
        const logB = recordingLogger();
        const { a, b, clientA, paused, close } = twoRelays({
          firstPassAfterMs: 0,
          everyMs: 20,
          log: createLogger({ level: "debug", write: logB.write }),
        });
        const skipped = () => logB.lines.filter((l) => l.event === "retention_skipped").length;
        try {
          a.retention.start();
          // A deleted its first batch and pauses, inside its pass, holding the lock.
          await waitFor("A's pause", () => paused.count() === 1);
          assert.deepEqual(await lockHolders(), [await backendPid(clientA)], "A's session holds the lock");

          b.retention.start();
          await waitFor("B's ticks, each skipped", () => skipped() >= 3);
          assert.equal(b.batches.length, 0, "B ran no DELETE while A's pass ran");
          assert.deepEqual(a.batches, [["outbox", 2]]);
          assert.equal(await count("outbox"), 4);

          // A stops: its pass ends in its pause, and the lock is free for B's next tick.
          await a.retention.stop();
          assert.deepEqual(a.batches, [["outbox", 2]], "A ran no batch after its stop");
          await waitFor("B's pass", () => b.batches.length >= 3);
          await b.retention.stop();
          assert.deepEqual(b.batches.slice(0, 3), [["outbox", 2], ["outbox", 2], ["outbox", 0]]);
          assert.ok(b.batches.slice(3).every(([, rows]) => rows === 0), "B's later passes found nothing");
          assert.equal(await count("outbox"), 0);
          assert.equal(logB.lines.find((l) => l.event === "retention_deleted")?.outbox, 4);
        } finally {
          await close();
        }
      },
    );

    await t.step(
      "a pass whose connection is lost ends before its next batch, and another relay's pass takes over",
      async () => {
        await resetWithSentRows(6);
        const { a, b, paused, close } = twoRelays();
        try {
          const passA = a.retention.runOnce().then(() => undefined, (error: Error) => error);
          await waitFor("A's pause", () => paused.count() === 1);
          // A's backend dies mid-pass (a failover, an operator): Postgres frees the lock with it.
          const [holder] = await lockHolders();
          await sql`SELECT pg_terminate_backend(${holder!})`;
          await waitFor("the lock freed", async () => (await lockHolders()).length === 0);
          // Meanwhile B's pass runs: the lock is free.
          assert.equal(await b.retention.runOnce(), 4);
          await addJobs(2);
          await sql`UPDATE outbox SET sent_at = now() - interval '10 days' WHERE sent_at IS NULL`;
          // A's pause ends; its connection is a new one without the lock, so A deletes nothing more.
          paused.release();
          const error = await passA;
          assert.match(String(error), /lost its advisory lock/, "A's pass checked its lock before its next batch");
          assert.deepEqual(a.batches, [["outbox", 2]]);
          assert.equal(await count("outbox"), 2, "the rows sent since are left for the next pass");
          assert.deepEqual(await lockHolders(), []);
          // A's client works again, and its next pass is a whole one.
          assert.equal(await a.retention.runOnce(), 2);
        } finally {
          await close();
        }
      },
    );

    await t.step("a connection lost between a batch's lock check and its delete deletes nothing", async () => {
      await resetWithSentRows(3);
      const client = oneConnection();
      let killed = false;
      try {
        const { retention } = retentionWith({
          sql: client,
          batch: 2,
          // The check passed; the connection dies before the delete is sent (a failover, an operator). Without
          // the check and the delete in one transaction, the delete went out on a new connection, lockless.
          async onLockChecked() {
            if (killed) return;
            killed = true;
            const [holder] = await lockHolders();
            await sql`SELECT pg_terminate_backend(${holder!})`;
            await waitFor("the lock freed", async () => (await lockHolders()).length === 0);
            // Time for the client to see its socket close, so that a statement sent now would go out on a new
            // connection (as it would after a failover's reconnect).
            await new Promise((resolve) => setTimeout(resolve, 200));
          },
        });
        const error = await retention.runOnce().then(() => undefined, (e: Error) => e);
        assert.ok(error, "the pass failed with its connection");
        assert.equal(await count("outbox"), 3, "no row deleted without the lock");
        assert.deepEqual(await lockHolders(), []);
        assert.equal(await retention.runOnce(), 3, "the next pass deletes them, under the lock");
      } finally {
        await client.end();
      }
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
