/**
 * A query planned while its table was small must not keep that plan as the table grows (issue 39). postgres.js
 * prepares every statement, and Postgres keeps a prepared statement's generic plan once it was no dearer than the
 * custom ones: planned on an empty `job_outcomes`, the worker's pre-check (`outcomesOf`) kept a sequential scan,
 * and a drain of 150,000 queued jobs read the whole table dozens of times a second (with autovacuum off, or before
 * its first ANALYZE). The service's connections plan each execution (`plan_cache_mode = force_custom_plan`).
 * Whether a default connection keeps the sequential scan depends on the planner's estimates for the batches it saw
 * (the drain bench showed it: README, "Lanes at scale"); here the setting is checked, and the pre-check after the
 * table grew.
 */
import assert from "node:assert/strict";
import { connectPostgres } from "../../src/clients.ts";
import { outcomesOf } from "../../src/jobs/job_store.ts";
import { createTestDatabase } from "../_support.ts";

Deno.test("the pre-check planned on an empty table uses the index once the table is large", async () => {
  const db = await createTestDatabase();
  const service = await connectPostgres(db.url, { max: 1 });
  const ids = () => Array.from({ length: 10 }, () => crypto.randomUUID());
  /** Rows of job_outcomes read by sequential scans so far (every backend's statistics flushed first). */
  const seqRead = async () => {
    await service`SELECT pg_stat_force_next_flush()`;
    await new Promise((resolve) => setTimeout(resolve, 50));
    const [row] = await db.sql<{ n: string }[]>`
      SELECT coalesce(seq_tup_read, 0)::text AS n FROM pg_stat_user_tables WHERE relname = 'job_outcomes'`;
    return Number(row?.n ?? 0);
  };
  try {
    assert.deepEqual([...await service`SHOW plan_cache_mode`], [{ plan_cache_mode: "force_custom_plan" }]);
    // Planned while the table is empty, more than the five custom plans after which a generic one may stick.
    for (let i = 0; i < 10; i++) {
      await outcomesOf(service, ids());
    }
    await db.sql`
      INSERT INTO job_outcomes (job_id, tenant, outcome)
      SELECT gen_random_uuid(), 't', 'done' FROM generate_series(1, 20000)`;
    const before = await seqRead();
    for (let i = 0; i < 5; i++) await outcomesOf(service, ids());
    const ours = await seqRead() - before;
    assert.ok(ours < 20_000, `the service's connection read ${ours} rows by sequential scan`);
  } finally {
    await service.end();
    await db.close();
  }
});
