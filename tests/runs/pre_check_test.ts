/**
 * The pre-check a worker makes while a message waits read ahead: when its query fails (here its connection is
 * ended by Postgres while it waits for a lock), that failure is no answer. The delivery asks again when it
 * starts, and the job completes on its first delivery instead of waiting out a redelivery.
 */
import assert from "node:assert/strict";
import postgres from "postgres";
import { createExtractiveLlm } from "../../src/llm/extractive.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { ensureGroup } from "../../src/queue/stream_worker.ts";
import { fieldsToObject } from "../../src/redis/fields.ts";
import { createGroupCommitter } from "../../src/runs/commit.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createSummaryJob } from "../../src/runs/run_job.ts";
import { createDeployment } from "../../src/provider/deployment.ts";
import { enqueueJob } from "../support/enqueue.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

const APP = "pre_check_blip";

Deno.test("a read-ahead pre-check that failed is asked again: the job completes on its first delivery", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix).lane("acme");
  // The job's own connections, named so that the test finds the one to end.
  const sql = postgres(db.url, { max: 2, onnotice: () => {}, connection: { application_name: APP } });
  const extractive = createExtractiveLlm();
  let calls = 0;
  const llm: typeof extractive = {
    complete(prompt, options) {
      calls++;
      return extractive.complete(prompt, options);
    },
  };
  const release = Promise.withResolvers<void>();
  let locking: Promise<unknown> | undefined;
  try {
    await ensureGroup(r.redis, keys);
    const jobId = crypto.randomUUID();
    await enqueueJob(r.redis, keys, {
      jobId,
      tenant: "acme",
      request: { text: "Revenue rose 12% in Q3. Costs fell. The board approved the plan.", notify: "ops@example.com" },
    });
    const reply = await r.redis.xreadgroup("GROUP", keys.group, "w", "COUNT", 1, "STREAMS", keys.stream, ">") as [
      string,
      [string, string[]][],
    ][];
    const [id, flat] = reply[0]![1][0]!;
    const message = { id, fields: fieldsToObject(flat), deliveries: 1 };
    const job = createSummaryJob({
      sql,
      models: createDeployment({ llm, model: "extractive" }),
      log: silentLogger,
      committer: createGroupCommitter({ sql, log: silentLogger }),
    }, { budgetMs: 5_000, perCallTimeoutMs: 2_000, maxAttempts: 2, backoffBaseMs: 1, backoffCapMs: 5 });

    // Postgres blips while the message waits read ahead: its pre-check's query waits for a lock, and its
    // connection is ended.
    const locked = Promise.withResolvers<void>();
    locking = db.sql.begin(async (tx) => {
      await tx`LOCK TABLE job_outcomes IN ACCESS EXCLUSIVE MODE`;
      locked.resolve();
      await release.promise;
    });
    await locked.promise;
    job.prepare(message);
    const [waiting] = await waitFor(
      "the read-ahead pre-check to wait for the lock",
      async () =>
        await db.sql<{ pid: number }[]>`
        SELECT pid FROM pg_stat_activity
        WHERE application_name = ${APP} AND wait_event_type = 'Lock' AND query ILIKE '%job_outcomes%'`
          .then((rows) => rows.length > 0 ? rows : undefined),
    );
    await db.sql`SELECT pg_terminate_backend(${waiting!.pid})`;
    await waitFor(
      "the ended connection to go",
      async () => (await db.sql`SELECT 1 FROM pg_stat_activity WHERE pid = ${waiting!.pid}`).length === 0,
    );
    release.resolve();
    await locking;

    assert.equal(await job(message, new AbortController().signal), "done", "done on its first delivery");
    assert.equal(calls, 1);
    const [row] = await db.sql<{ s: number; o: number; d: number }[]>`
      SELECT (SELECT count(*) FROM summaries)::int AS s, (SELECT count(*) FROM outbox)::int AS o,
        (SELECT count(*) FROM job_outcomes WHERE job_id = ${jobId} AND outcome = 'done')::int AS d`;
    assert.deepEqual([row!.s, row!.o, row!.d], [1, 1, 1], "one summary, one outbox row, decided done");
  } finally {
    release.resolve();
    await locking?.catch(() => {});
    await sql.end({ timeout: 1 });
    await r.close();
    await db.close();
  }
});
