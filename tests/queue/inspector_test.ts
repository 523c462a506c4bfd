import assert from "node:assert/strict";
import { deadLetter } from "../../src/queue/dead_letter.ts";
import {
  consumers,
  deadLetterCount,
  deadLetterPages,
  droppedPerLane,
  groupLag,
  laneStats,
  oldestAgeMs,
  pendingCount,
  workers,
} from "../../src/queue/inspector.ts";
import { fieldsToObject } from "../../src/redis/fields.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createTestRedis } from "../_support.ts";

Deno.test("fieldsToObject() reads a flat reply, stream fields or an XINFO record with numbers", () => {
  assert.deepEqual(fieldsToObject(["a", "1", "b", "2", "dangling"]), { a: "1", b: "2" });
  assert.deepEqual(fieldsToObject<unknown>(["name", "c1", "pending", 3, "idle", 40]), {
    name: "c1",
    pending: 3,
    idle: 40,
  });
});

Deno.test("the inspector reads a lane's depth, pending count, lag, oldest entry, consumers and dead letters", async () => {
  const r = await createTestRedis();
  try {
    const keys = serviceKeys(r.prefix);
    const acme = keys.lane("acme"), beta = keys.lane("beta");
    // A lane nobody wrote to: nothing, and no error for the missing stream or group.
    assert.deepEqual(await laneStats(r.redis, acme), { depth: 0, pending: 0 });
    assert.equal(await pendingCount(r.redis, acme), 0);
    assert.equal(await groupLag(r.redis, acme), 0);
    assert.equal(await oldestAgeMs(r.redis, acme), undefined);
    assert.deepEqual(await consumers(r.redis, acme), []);

    for (let i = 0; i < 3; i++) await r.redis.xadd(acme.stream, "*", "job_id", `j${i}`);
    await r.redis.xgroup("CREATE", acme.stream, acme.group, "0");
    await r.redis.xreadgroup("GROUP", acme.group, "worker-a", "COUNT", 2, "STREAMS", acme.stream, ">");
    await r.redis.xadd(beta.stream, "*", "job_id", "b0");
    await r.redis.xgroup("CREATE", beta.stream, beta.group, "0");
    await r.redis.xreadgroup("GROUP", beta.group, "worker-a", "COUNT", 1, "STREAMS", beta.stream, ">");
    await r.redis.xgroup("CREATECONSUMER", beta.stream, beta.group, "worker-b");

    assert.deepEqual(await laneStats(r.redis, acme), { depth: 3, pending: 2 });
    assert.equal(await groupLag(r.redis, acme), 1, "one entry not yet delivered");
    const age = await oldestAgeMs(r.redis, acme);
    assert.ok(age !== undefined && age >= 0 && age < 60_000, String(age));
    const [consumer] = await consumers(r.redis, acme);
    assert.equal(consumer!.name, "worker-a");
    assert.equal(consumer!.pending, 2);
    assert.equal(typeof consumer!.idle, "number");

    const lanes = [{ tenant: "acme", keys: acme }, { tenant: "beta", keys: beta }];
    const seen = await workers(r.redis, lanes);
    assert.deepEqual(seen.map((w) => [w.name, w.lanes, w.pending]), [["worker-a", 2, 3], ["worker-b", 1, 0]]);

    for (const [lane, id] of [[acme, "1-1"], [beta, "1-2"], [beta, "1-3"]] as const) {
      // The dead-letter step moves only a message still in its lane.
      const entry = await r.redis.xadd(lane.stream, "*", "job_id", id) as string;
      await deadLetter(r.redis, lane, { id: entry, fields: { job_id: id }, deliveries: 5 }, "gave up");
    }
    assert.equal(await deadLetterCount(r.redis, beta), 2);
    const listed: string[] = [];
    for await (const page of deadLetterPages(r.redis, lanes, 1)) {
      assert.equal(page.length, 1, "pages of the size asked for");
      listed.push(...page.map((d) => `${d.lane.tenant}:${d.fields.job_id}:${d.reason}`));
    }
    assert.deepEqual(listed, ["acme:1-1:gave up", "beta:1-2:gave up", "beta:1-3:gave up"]);
    assert.deepEqual(await droppedPerLane(r.redis, lanes), []);
  } finally {
    await r.close();
  }
});
