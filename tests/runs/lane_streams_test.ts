/**
 * The summary worker on lanes of two streams (the key book's `laneStreams`): the high stream's jobs go first by its
 * share, and a job's record and dead letter are its lane's whichever stream it came from.
 */
import assert from "node:assert/strict";
import { createExtractiveLlm } from "../../src/llm/extractive.ts";
import { listDeadLetters } from "../../src/queue/dead_letter.ts";
import { announceLane } from "../../src/queue/lanes.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { enqueueJob, enqueueToLane } from "../support/enqueue.ts";
import { summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis } from "../_support.ts";

Deno.test("the summary worker reads every stream of a tenant's lane, in the lane's order", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix, { laneStreams: ["high", "stream"] });
  const lane = keys.lane("acme");
  // The first stream in the lane's order; intake writes the lane's `stream`, the second.
  const high = { stream: lane.streams[0]!, job: (jobId: string) => lane.job(jobId) };
  const extractive = createExtractiveLlm();
  const prompts: string[] = [];
  const llm: typeof extractive = {
    complete(prompt, options) {
      prompts.push(prompt);
      return extractive.complete(prompt, options);
    },
  };
  const job = (name: string) => ({
    jobId: crypto.randomUUID(),
    tenant: "acme",
    request: { text: `Revenue rose in ${name}. Costs fell.`, notify: "ops@example.com" },
  });
  try {
    await t.step("the key book names the lane's streams in order, the intake stream among them", () => {
      assert.deepEqual(lane.streams, [`${r.prefix}:{t:acme}:high`, `${r.prefix}:{t:acme}:stream`]);
      assert.equal(lane.stream, `${r.prefix}:{t:acme}:stream`);
      const normal = serviceKeys(r.prefix).lane("acme");
      assert.deepEqual(
        normal.streams,
        [normal.stream, `${r.prefix}:{t:acme}:high`, `${r.prefix}:{t:acme}:low`],
        "the default lane has one stream per priority, intake's (normal) first: it names the lane",
      );
      assert.deepEqual([normal.streamOf("high"), normal.streamOf(undefined)], [normal.streams[1], normal.stream]);
      assert.equal(lane.streamOf("low"), lane.stream, "a lane without a low stream queues low runs as normal");
      assert.throws(() => serviceKeys(r.prefix, { laneStreams: ["high"] }), TypeError);
    });

    await t.step("jobs in both streams are done, the first stream's first, and acked", async () => {
      const later = [job("later0"), job("later1")];
      const first = [job("first0"), job("first1")];
      for (const j of later) await enqueueToLane(r.redis, keys, j);
      for (const j of first) await enqueueJob(r.redis, high, j);
      await announceLane(r.redis, keys.registry, "acme");
      const worker = summaryWorker({ redis: r.redis, sql: db.sql, llm, keys }, { concurrency: 1 });
      try {
        for (let i = 0; i < 4; i++) {
          assert.equal(await worker.runOnce(0), 1);
          await worker.drain();
        }
      } finally {
        await worker.close();
      }
      const order = ["first0", "first1", "later0", "later1"];
      assert.deepEqual(prompts.map((p) => order.find((name) => p.includes(`in ${name}.`))), order);
      const [row] = await db.sql<{ n: number }[]>`SELECT count(*)::int AS n FROM summaries`;
      assert.equal(row!.n, 4);
      for (const stream of lane.streams) assert.equal(await r.redis.xlen(stream), 0, `${stream} acked`);
      for (const j of [...first, ...later]) {
        // The ack starts each job's record's lifetime, whichever stream held it.
        assert.ok(await r.redis.ttl(lane.job(j.jobId)) > 0, `${j.request.text}: record expires`);
      }
    });

    await t.step("a job of the first stream that fails for good is dead-lettered and marked failed", async () => {
      const jobId = crypto.randomUUID();
      await r.redis.hset(lane.job(jobId), "tenant", "acme", "status", "queued");
      await r.redis.xadd(high.stream, "*", "job_id", jobId, "tenant", "acme", "payload", "{");
      await announceLane(r.redis, keys.registry, "acme");
      const worker = summaryWorker({ redis: r.redis, sql: db.sql, llm, keys });
      try {
        assert.equal(await worker.runOnce(0), 1);
        await worker.drain();
      } finally {
        await worker.close();
      }
      const dead = await listDeadLetters(r.redis, lane);
      assert.deepEqual(dead.map((d) => d.fields.job_id), [jobId]);
      assert.equal(await r.redis.hget(lane.job(jobId), "status"), "failed");
      assert.equal(await r.redis.xlen(high.stream), 0);
    });
  } finally {
    await r.close();
    await db.close();
  }
});
