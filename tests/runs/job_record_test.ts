import assert from "node:assert/strict";
import { serviceKeys } from "../../src/runs/keys.ts";
import { jobDocument } from "../../src/runs/job_document.ts";
import { markCancelled, readJobRecord } from "../../src/runs/job_status.ts";
import { createTestDatabase, createTestRedis } from "../_support.ts";

Deno.test("readJobRecord() finds a job's record in its tenant's lane, and (for an operator) in any lane", async () => {
  const r = await createTestRedis();
  try {
    const keys = serviceKeys(r.prefix);
    const [inLane, inBeta] = [crypto.randomUUID(), crypto.randomUUID()];
    await r.redis.hset(keys.lane("acme").job(inLane), "tenant", "acme", "status", "queued");
    await r.redis.sadd(keys.registry.all, "acme", "beta");
    await r.redis.hset(keys.lane("beta").job(inBeta), "tenant", "beta", "status", "failed", "error", "boom");

    assert.deepEqual(await readJobRecord(r.redis, keys, inLane, "acme"), {
      record: { tenant: "acme", status: "queued" },
      key: keys.lane("acme").job(inLane),
    });
    assert.equal(await readJobRecord(r.redis, keys, inLane, "beta"), null, "another tenant's job is unknown");
    assert.equal((await readJobRecord(r.redis, keys, inBeta, "beta"))?.key, keys.lane("beta").job(inBeta));
    assert.equal(await readJobRecord(r.redis, keys, inBeta, "acme"), null);

    assert.equal((await readJobRecord(r.redis, keys, inLane))?.record.tenant, "acme", "any tenant's, for an operator");
    assert.equal((await readJobRecord(r.redis, keys, inBeta))?.record.error, "boom", "in the second lane too");
    assert.equal(await readJobRecord(r.redis, keys, crypto.randomUUID()), null);
  } finally {
    await r.close();
  }
});

Deno.test("a queued job's record without a status (this release's) reads as the one with `queued` (the release before's)", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  try {
    const keys = serviceKeys(r.prefix);
    const lane = keys.lane("acme");
    const [now, before, run] = [crypto.randomUUID(), crypto.randomUUID(), crypto.randomUUID()];
    await r.redis.hset(lane.job(now), "tenant", "acme");
    await r.redis.hset(lane.job(before), "tenant", "acme", "status", "queued");
    await r.redis.hset(lane.job(run), "tenant", "acme", "task", "triage", "version", "2");
    await r.redis.sadd(keys.registry.all, "acme");
    for (const jobId of [now, before]) {
      const found = await jobDocument({ redis: r.redis, sql: db.sql, keys }, "acme", jobId);
      assert.deepEqual(found?.document, { job_id: jobId, status: "queued" });
      assert.deepEqual(found?.run, { task: "summarize", version: 1, summaryJob: true });
      assert.equal(await jobDocument({ redis: r.redis, sql: db.sql, keys }, "beta", jobId), null);
      assert.equal((await readJobRecord(r.redis, keys, jobId))?.key, lane.job(jobId), "found by an operator");
    }
    const found = await jobDocument({ redis: r.redis, sql: db.sql, keys }, "acme", run);
    assert.deepEqual(found?.document, { job_id: run, status: "queued" });
    assert.deepEqual(found?.run, { task: "triage", version: 2, summaryJob: false });
    // A cancel marks it as before.
    await markCancelled(r.redis, lane.job(now));
    assert.deepEqual(await r.redis.hgetall(lane.job(now)), { tenant: "acme", status: "cancelled" });
  } finally {
    await r.close();
    await db.close();
  }
});
