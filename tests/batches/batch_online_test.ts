/**
 * The Batch API's online path (`batch_online.ts`): a run its batch left unfinished goes back on its lane's low
 * stream as a `low` run, once, even when it is sent twice (a resend after a lost reply, or a poller stopped
 * between the send and recording the run settled). Real Redis and Postgres; the runs then go through a real
 * worker, which commits each once.
 */
import assert from "node:assert/strict";
import { createBatchOnline, onlinePayload } from "../../src/batches/batch_online.ts";
import { createBatchPoller } from "../../src/batches/batch_poller.ts";
import { createBatchSubmitter } from "../../src/batches/batch_submitter.ts";
import { createExtractiveLlm } from "../../src/llm/extractive.ts";
import { createGroupCommitter } from "../../src/runs/commit.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { runOfPayload } from "../../src/runs/run_payload.ts";
import { summaryWorker } from "../support/fixtures.ts";
import { createTestRedis, waitFor } from "../_support.ts";
import { Redis } from "ioredis";
import { connectRedis } from "../../src/clients.ts";
import { createReplicaAck, NotReplicated } from "../../src/redis/replica_ack.ts";
import { startLocalReplication } from "../support/redis_replication.ts";
import { batchPayload, batchWorld, Crash } from "./_fixture.ts";

Deno.test("onlinePayload() makes a batch run a low run, which no batch takes again", () => {
  const run = runOfPayload(onlinePayload(batchPayload("Some text.")));
  assert.equal(run.priority, "low");
  assert.equal(run.task, "summarize");
});

Deno.test("the online hook sent twice for one run queues it once, on its lane's low stream", async () => {
  const r = await createTestRedis();
  try {
    const keys = serviceKeys(r.prefix);
    const online = createBatchOnline({ redis: r.redis, keys });
    const run = { runId: crypto.randomUUID(), tenant: "acme", payload: batchPayload("Text."), acceptedMs: 1_000 };
    assert.deepEqual([await online(run), await online(run)], [true, false]);
    const lane = keys.lane("acme");
    const entries = await r.redis.xrange(lane.streamOf("low"), "-", "+");
    assert.equal(entries.length, 1);
    const fields = Object.fromEntries(
      entries[0]![1].reduce<string[][]>((all, v, i) => (i % 2 ? all[all.length - 1]!.push(v) : all.push([v]), all), []),
    );
    assert.equal(fields.job_id, run.runId);
    assert.equal(fields.accepted_ms, "1000", "its age counts from its first acceptance");
    assert.equal(JSON.parse(fields.payload!).priority, "low");
    assert.equal(await r.redis.hget(lane.job(run.runId), "status"), "queued");
    assert.equal(await r.redis.ttl(lane.job(run.runId)), -1, "its record lives while it waits");
    assert.ok(await r.redis.sismember(keys.registry.all, "acme"), "its lane is known");
  } finally {
    await r.close();
  }
});

Deno.test("a poller stopped between the online send and recording it: the run is queued once, done once, notified once", async () => {
  const world = await batchWorld({
    maxRuns: 4,
    script: () => ({ end: "expired", line: (_id, _b, i) => (i < 2 ? { kind: "ok" } : { kind: "unfinished" }) }),
  });
  const r = await createTestRedis();
  try {
    const keys = serviceKeys(r.prefix);
    const runIds = await world.recordRuns(4);
    await createBatchSubmitter(world, { maxWaitMs: 3_600_000 }).runOnce();
    let stops = 0;
    const poller = (crash: boolean) =>
      createBatchPoller({ ...world, committer: createGroupCommitter({ sql: world.sql, log: world.log }) }, {
        onExpiry: "online",
        online: createBatchOnline({ redis: r.redis, keys }),
        leaseMs: 0,
        fault: (step) => {
          if (crash && step === "online_sent") {
            stops++;
            throw new Crash(step);
          }
        },
      });
    // Polled (ended), then stopped right after its first online send.
    await assert.rejects(poller(true).runOnce(), Crash);
    assert.equal(stops, 1);
    // The next process reads the files again: it sends that run again (and the other one), then settles all.
    assert.equal(await poller(false).runOnce(), 1);
    const low = keys.lane("acme").streamOf("low");
    assert.equal(await r.redis.xlen(low), 2, "two unfinished runs, each queued once");
    const settled = await world.sql<{ settled: string; n: number }[]>`
      SELECT settled, count(*)::int AS n FROM batch_runs GROUP BY settled ORDER BY settled`;
    assert.deepEqual(settled.map((s) => [s.settled, s.n]), [["committed", 2], ["online", 2]]);

    // A worker runs them online.
    const worker = summaryWorker({ redis: r.redis, sql: world.sql, llm: createExtractiveLlm(), keys }, {
      consumer: "online-test",
    });
    const stop = new AbortController();
    const running = worker.run(stop.signal);
    try {
      await waitFor("4 runs decided", async () => {
        const [n] = await world.sql<{ n: number }[]>`
          SELECT count(*)::int AS n FROM job_outcomes WHERE job_id = ANY(${runIds}::uuid[])`;
        return n!.n === 4;
      }, 10_000);
    } finally {
      stop.abort();
      await running;
      await worker.close();
    }
    const outcomes = await world.sql<{ outcome: string; n: number }[]>`
      SELECT outcome, count(*)::int AS n FROM job_outcomes GROUP BY outcome`;
    assert.deepEqual(outcomes.map((o) => [o.outcome, o.n]), [["done", 4]]);
    const [outbox] = await world.sql<{ rows: number; runs: number }[]>`
      SELECT count(*)::int AS rows, count(DISTINCT payload->>'job_id')::int AS runs FROM outbox`;
    assert.deepEqual(outbox, { rows: 4, runs: 4 }, "one notification each");
    assert.equal(world.server.requests, 0, "the extractive model served the online runs");
    assert.equal(world.server.batches.counts.creates, 1, "not batched again");
  } finally {
    await r.close();
    await world.close();
  }
});

Deno.test("REDIS_MIN_REPLICAS_ACK: an online send answers only once the replica has the entry, and a resend covers it", async () => {
  const local = await startLocalReplication();
  const redis = await connectRedis(local.primary, { failFast: true }) as Redis;
  const replica = new Redis(local.replica);
  replica.on("error", () => {}); // killed and restarted below
  const ack = createReplicaAck(redis, { replicas: 1, timeoutMs: 300 });
  try {
    const keys = serviceKeys(`oncely_test_${crypto.randomUUID().slice(0, 8)}`);
    const low = keys.lane("acme").streamOf("low");
    const online = createBatchOnline({ redis, keys, ack });
    const run = () => ({ runId: crypto.randomUUID(), tenant: "acme", payload: batchPayload("Text."), acceptedMs: 1 });
    const onReplica = async (runId: string) =>
      (await replica.xrange(low, "-", "+")).filter(([, f]) => f[f.indexOf("job_id") + 1] === runId).length;

    const first = run();
    assert.equal(await online(first), true);
    assert.equal(await onReplica(first.runId), 1, "on the replica when the send returns");

    // The replica stalls: the send throws, so the poller does not record the line `online`, and sends it again.
    const second = run();
    local.pause();
    await assert.rejects(online(second), NotReplicated);
    await local.resume();
    // The resend adds nothing (the marker), and still waits: its own write covers the entry the first one wrote.
    const waits = async () => Number(/cmdstat_wait:calls=(\d+)/.exec(await redis.info("commandstats"))?.[1] ?? 0);
    const before = await waits();
    assert.equal(await online(second), false);
    assert.equal(await waits(), before + 1, "the resend waited for the replica");
    assert.equal(await onReplica(second.runId), 1);
    assert.equal((await redis.xrange(low, "-", "+")).length, 2, "each run queued once");
  } finally {
    await ack.close();
    replica.disconnect();
    redis.disconnect();
    await local.stop();
  }
});
