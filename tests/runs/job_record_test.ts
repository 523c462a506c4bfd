import assert from "node:assert/strict";
import { serviceKeys } from "../../src/runs/keys.ts";
import { readJobRecord } from "../../src/runs/job_status.ts";
import { createTestRedis } from "../_support.ts";

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
