/**
 * The move off the single `{jobs}` stream of releases before lanes: whatever
 * an upgrade left there (new or pending) runs once, from its tenant's lane,
 * and the old stream is gone. (Run on one Redis and, by
 * `deno task test:cluster`, on a Redis Cluster.)
 */
import assert from "node:assert/strict";
import type { LLM } from "../../src/llm/llm.ts";
import { createExtractiveLlm } from "../../src/llm/extractive.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { ensureGroup } from "../../src/queue/stream_worker.ts";
import { drainLegacyStream, keepDrainingLegacyStream } from "../../src/runs/legacy_drain.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { enqueueJob } from "../support/enqueue.ts";
import { apiHandler, summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

const TEXT = "Revenue rose 12% in Q3. Costs fell. The board approved the plan. Staff were told on Friday.";

Deno.test("legacy drain", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const legacy = keys.legacy;
  let calls = 0;
  const countingLlm: LLM = {
    complete(prompt, options) {
      calls++;
      return createExtractiveLlm().complete(prompt, options);
    },
  };
  const api = apiHandler({ redis: r.redis, sql: db.sql, keys }, { authMode: "api-key" });
  const statusOf = async (apiKey: string, jobId: string) =>
    (await (await api(
      new Request(`http://api/v1/summaries/${jobId}`, { headers: { authorization: `Bearer ${apiKey}` } }),
    )).json()).status;
  const effects = async (jobId: string) => {
    const [row] = await db.sql<{ s: number; o: number }[]>`
      SELECT (SELECT count(*) FROM summaries WHERE job_id = ${jobId}::uuid)::int AS s,
        (SELECT count(*) FROM outbox WHERE payload->>'job_id' = ${jobId})::int AS o`;
    return [row!.s, row!.o];
  };
  const job = (tenant: string) => ({
    jobId: crypto.randomUUID(),
    tenant,
    request: { text: TEXT, notify: "ops@example.com" },
  });
  /** Runs a summary worker (which drains the old stream as it starts) until `done` holds. */
  const runWorkerUntil = async (what: string, done: () => Promise<boolean>) => {
    const stop = new AbortController();
    const worker = summaryWorker({ redis: r.redis, sql: db.sql, llm: countingLlm, keys }, {
      consumer: `w-${crypto.randomUUID().slice(0, 8)}`,
    });
    const running = worker.run(stop.signal);
    try {
      await waitFor(what, done, 10_000);
    } finally {
      stop.abort();
      await running;
      await worker.close();
    }
  };

  try {
    await t.step(
      "a new and a pending job left in the old stream each run once, and the old stream is gone",
      async () => {
        const apiKey = await createApiKey(db.sql, "upgraded");
        const fresh = job("upgraded");
        const pending = job("upgraded");
        await enqueueJob(r.redis, legacy, fresh);
        await enqueueJob(r.redis, legacy, pending);
        // An old worker read the first one (pending, its delivery under way) and then stopped for the upgrade.
        await ensureGroup(r.redis, legacy);
        await r.redis.xreadgroup("GROUP", legacy.group, "old-worker", "COUNT", 1, "STREAMS", legacy.stream, ">");
        calls = 0;
        await runWorkerUntil("both jobs done", async () => {
          const [[a], [b]] = await Promise.all([effects(fresh.jobId), effects(pending.jobId)]);
          return a === 1 && b === 1;
        });
        assert.deepEqual(await effects(fresh.jobId), [1, 1], "one summary, one email");
        assert.deepEqual(await effects(pending.jobId), [1, 1], "one summary, one email");
        assert.equal(calls, 2, "one model call per job");
        assert.equal(await r.redis.exists(legacy.stream), 0, "the old stream and its group are deleted");
        assert.equal(await r.redis.xlen(keys.lane("upgraded").stream), 0, "the lane acked both");
        assert.equal(await statusOf(apiKey, fresh.jobId), "done");
      },
    );

    await t.step("a drained job's status record moves with it: GET finds it queued in its lane", async () => {
      const apiKey = await createApiKey(db.sql, "waiting");
      const queued = job("waiting");
      await enqueueJob(r.redis, legacy, queued);
      // Records of releases before this one expired after 7 days, queued or not.
      await r.redis.expire(legacy.job(queued.jobId), 7 * 86_400);
      assert.equal(await drainLegacyStream({ redis: r.redis, log: silentLogger }, { keys }), 1);
      assert.equal(await r.redis.ttl(keys.lane("waiting").job(queued.jobId)), -1, "no expiry while it waits");
      assert.equal(await r.redis.exists(legacy.stream), 0);
      assert.equal(await r.redis.xlen(keys.lane("waiting").stream), 1);
      assert.deepEqual(await r.redis.smembers(keys.registry.active), ["waiting"], "the lane is announced");
      assert.equal(await statusOf(apiKey, queued.jobId), "queued");
      assert.equal(await drainLegacyStream({ redis: r.redis, log: silentLogger }, { keys }), 0, "nothing left");
      // Not run here: the next steps count model calls.
      await r.redis.del(keys.lane("waiting").stream);
    });

    await t.step("a drain that died between the lane's XADD and the old stream's XDEL adds nothing twice", async () => {
      await createApiKey(db.sql, "halfmoved");
      const moved = job("halfmoved");
      const id = await enqueueJob(r.redis, legacy, moved);
      const fields = await r.redis.xrange(legacy.stream, id, id);
      assert.equal(await drainLegacyStream({ redis: r.redis, log: silentLogger }, { keys }), 1);
      // As if the first drain had died before its XDEL: the entry is in the old stream again, same id.
      await r.redis.xadd(legacy.stream, id, ...fields[0]![1]);
      assert.equal(await drainLegacyStream({ redis: r.redis, log: silentLogger }, { keys }), 1);
      assert.equal(await r.redis.exists(legacy.stream), 0);
      assert.equal(await r.redis.xlen(keys.lane("halfmoved").stream), 1, "one entry in the lane, not two");
      calls = 0;
      await runWorkerUntil("the job done", async () => (await effects(moved.jobId))[0] === 1);
      assert.deepEqual(await effects(moved.jobId), [1, 1]);
      assert.equal(calls, 1);
    });

    await t.step("a job delivered from both the old stream and its lane commits once", async () => {
      await createApiKey(db.sql, "twice");
      const twice = job("twice");
      // The duplicate no marker prevents: an old worker's delivery still under way while its entry moved.
      await enqueueJob(r.redis, keys.lane("twice"), twice);
      await enqueueJob(r.redis, legacy, twice);
      await runWorkerUntil("both entries settled", async () => {
        const [s] = await effects(twice.jobId);
        return s === 1 && (await r.redis.xlen(keys.lane("twice").stream)) === 0 &&
          (await r.redis.exists(legacy.stream)) === 0;
      });
      assert.deepEqual(await effects(twice.jobId), [1, 1], "one summary, one email");
    });

    await t.step("an entry naming no tenant stays where it is, and so does the old stream", async () => {
      const id = await r.redis.xadd(legacy.stream, "*", "job_id", crypto.randomUUID()) as string;
      assert.equal(await drainLegacyStream({ redis: r.redis, log: silentLogger }, { keys }), 0);
      assert.deepEqual((await r.redis.xrange(legacy.stream, "-", "+")).map(([x]) => x), [id]);
      await r.redis.del(legacy.stream);
    });

    await t.step(
      "an entry written after the first drain (an old API still running) is moved at the next look",
      async () => {
        const stop = new AbortController();
        const looking = keepDrainingLegacyStream({ redis: r.redis, log: silentLogger }, {
          keys,
          signal: stop.signal,
          recheckMs: 50,
        });
        try {
          await new Promise((resolve) => setTimeout(resolve, 120));
          const late = job("late");
          await enqueueJob(r.redis, legacy, late);
          await waitFor("the late entry in its lane", async () => (await r.redis.xlen(keys.lane("late").stream)) === 1);
          await waitFor("the old stream gone again", async () => (await r.redis.exists(legacy.stream)) === 0);
        } finally {
          stop.abort();
          await looking;
        }
      },
    );
  } finally {
    await r.close();
    await db.close();
  }
});
