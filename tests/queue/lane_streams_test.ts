/**
 * A lane of two streams, read in the lane's order: the first stream first, the next for what the first did not
 * have. Every step on a message is its stream's (its group, its ack, its reclaim, its heartbeat, its dead letter),
 * and the in-flight cap and the pruner count the whole lane.
 */
import assert from "node:assert/strict";
import { listDeadLetters } from "../../src/queue/dead_letter.ts";
import { PermanentJobError } from "../../src/queue/errors.ts";
import { laneStats } from "../../src/queue/inspector.ts";
import { announceLane, createLaneRegistry, laneRegistryKeys } from "../../src/queue/lanes.ts";
import type { LaneNames, StreamMessage } from "../../src/queue/message.ts";
import { createStreamWorker, type MessageHandler, type StreamWorkerOptions } from "../../src/queue/stream_worker.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { createTestRedis } from "../_support.ts";

Deno.test("a lane of two streams", async (t) => {
  const r = await createTestRedis();
  let run = 0;
  /** A fresh registry with lane `id` of two streams, `high` read before `stream`. */
  const setup = () => {
    const prefix = `${r.prefix}:run${run++}`;
    const keys = laneRegistryKeys(prefix);
    const tag = `${prefix}:{t:acme}`;
    const lane: LaneNames = { streams: [`${tag}:high`, `${tag}:stream`], dead: `${tag}:dead`, group: "g" };
    const [high, low] = lane.streams as [string, string];
    const registry = createLaneRegistry({ redis: r.redis, log: silentLogger }, { keys, lane: () => lane });
    /** Adds messages named `<name>0`, `<name>1`, ... to `stream`, and announces the lane as intake does. */
    const add = async (stream: string, name: string, n: number) => {
      const ids: string[] = [];
      for (let i = 0; i < n; i++) ids.push(await r.redis.xadd(stream, "*", "job_id", `${name}${i}`) as string);
      await announceLane(r.redis, keys, "acme");
      return ids;
    };
    const workerWith = (consumer: string, handler: MessageHandler, overrides: Partial<StreamWorkerOptions> = {}) =>
      createStreamWorker({ redis: r.redis, log: silentLogger }, {
        lanes: registry,
        reclaimIntervalMs: 0,
        consumer,
        claimIdleMs: 60_000,
        maxDeliveries: 5,
        concurrency: 1,
        blockMs: 10,
        ...overrides,
      }, handler);
    const pending = async (stream: string) =>
      (await r.redis.xpending(stream, "g", "-", "+", 100) as [string, string, number, number][])
        .map(([id, owner, , deliveries]) => ({ id, owner, deliveries }));
    return { keys, lane, high, low, registry, add, workerWith, pending };
  };
  const jobOf = (m: StreamMessage) => m.fields.job_id!;

  try {
    await t.step("messages in both streams are read in the lane's order, processed and acked", async () => {
      const { keys, lane, high, low, registry, add, workerWith, pending } = setup();
      await add(low, "low", 3);
      await add(high, "high", 2);
      const done: string[] = [];
      const worker = workerWith("w", (m) => (done.push(jobOf(m)), Promise.resolve()));
      try {
        for (let i = 0; i < 3; i++) {
          assert.equal(await worker.runOnce(0), 1);
          await worker.drain();
        }
        // The first stream again has work: it goes before the rest of the second.
        await add(high, "late", 1);
        for (let i = 0; i < 3; i++) {
          assert.equal(await worker.runOnce(0), 1);
          await worker.drain();
        }
        assert.equal(await worker.runOnce(0), 0, "nothing left");
        assert.deepEqual(done, ["high0", "high1", "low0", "late0", "low1", "low2"]);
        for (const stream of lane.streams) {
          assert.deepEqual(await pending(stream), [], `${stream}: every message acked`);
          assert.equal(await r.redis.xlen(stream), 0, `${stream}: and deleted`);
        }
        assert.deepEqual(await r.redis.smembers(keys.active), [], "the empty lane left the active set");
      } finally {
        await worker.close();
        await registry.close();
      }
    });

    await t.step("one read fills its free slots from the first stream, then the next", async () => {
      const { high, low, registry, add, workerWith } = setup();
      await add(high, "high", 2);
      await add(low, "low", 5);
      const started: string[] = [];
      const worker = workerWith("w", (m) => (started.push(jobOf(m)), Promise.resolve()), { concurrency: 4 });
      try {
        assert.equal(await worker.runOnce(0), 4);
        await worker.drain();
        assert.deepEqual(started, ["high0", "high1", "low0", "low1"]);
        assert.deepEqual(await laneStats(r.redis, { streams: [high, low], dead: "", group: "g" }), {
          depth: 3,
          pending: 0,
        });
      } finally {
        await worker.close();
        await registry.close();
      }
    });

    await t.step("messages a crashed consumer took from both streams are reclaimed and acked", async () => {
      const { lane, high, low, registry, add, workerWith, pending } = setup();
      const [highId] = await add(high, "high", 1);
      const [lowId] = await add(low, "low", 1);
      // Worker A takes both, then dies before its handlers end: nothing is acked.
      const a = workerWith(
        "a",
        (_m, signal) => new Promise((_, reject) => signal.addEventListener("abort", () => reject(signal.reason))),
        { concurrency: 2 },
      );
      assert.equal(await a.runOnce(0), 2);
      await a.close();
      await a.drain();
      assert.deepEqual(await pending(high), [{ id: highId, owner: "a", deliveries: 1 }]);
      assert.deepEqual(await pending(low), [{ id: lowId, owner: "a", deliveries: 1 }]);
      const reclaimed: { job: string; deliveries: number }[] = [];
      const b = workerWith(
        "b",
        (m) => (reclaimed.push({ job: jobOf(m), deliveries: m.deliveries }), Promise.resolve()),
        {
          claimIdleMs: 0,
          concurrency: 2,
        },
      );
      try {
        assert.equal(await b.runOnce(0), 2);
        await b.drain();
        assert.deepEqual(reclaimed, [{ job: "high0", deliveries: 2 }, { job: "low0", deliveries: 2 }]);
        for (const stream of lane.streams) {
          assert.deepEqual(await pending(stream), [], `${stream}: acked after the reclaim`);
          assert.equal(await r.redis.xlen(stream), 0);
        }
      } finally {
        await b.close();
        await registry.close();
      }
    });

    await t.step("the in-flight cap counts the lane's pending messages in both streams", async () => {
      const { high, low, registry, add, workerWith, pending } = setup();
      await add(high, "high", 2);
      await add(low, "low", 3);
      const release = Promise.withResolvers<void>();
      const started: string[] = [];
      const worker = workerWith("w", async (m) => {
        started.push(jobOf(m));
        await release.promise;
      }, { concurrency: 10, laneMaxInFlight: 3 });
      try {
        assert.equal(await worker.runOnce(0), 3);
        assert.equal(await worker.runOnce(0), 0, "capped");
        assert.deepEqual(started, ["high0", "high1", "low0"]);
        assert.equal((await pending(high)).length + (await pending(low)).length, 3);
        // Heartbeats refresh the messages held in each stream.
        assert.equal((await worker.heartbeat()).length, 3);
        release.resolve();
        await worker.drain();
        assert.equal(await worker.runOnce(0), 2);
        await worker.drain();
        assert.deepEqual(started.slice(3), ["low1", "low2"]);
      } finally {
        await worker.close();
        await registry.close();
      }
    });

    await t.step("a message of the second stream dead-letters into the lane's dead letters", async () => {
      const { lane, high, low, registry, add, workerWith, pending } = setup();
      await add(high, "high", 1);
      const [poison] = await add(low, "poison", 1);
      const worker = workerWith("w", (m) => {
        if (jobOf(m) === "poison0") throw new PermanentJobError("unreadable");
        return Promise.resolve();
      }, { concurrency: 2 });
      try {
        assert.equal(await worker.runOnce(0), 2);
        await worker.drain();
        const dead = await listDeadLetters(r.redis, lane);
        assert.deepEqual(dead.map((d) => [d.original_id, d.fields.job_id, d.reason]), [
          [poison, "poison0", "permanent: unreadable"],
        ]);
        assert.deepEqual([await pending(high), await pending(low)], [[], []]);
        assert.deepEqual([await r.redis.xlen(high), await r.redis.xlen(low)], [0, 0]);
      } finally {
        await worker.close();
        await registry.close();
      }
    });

    await t.step("an idle consumer leaves the group of each stream", async () => {
      const { lane, high, low, registry, add, workerWith } = setup();
      await add(low, "low", 1);
      for (const stream of lane.streams) {
        await r.redis.xgroup("CREATE", stream, "g", "0", "MKSTREAM").catch(() => {});
        await r.redis.xgroup("CREATECONSUMER", stream, "g", "ghost");
      }
      const worker = workerWith("w", () => Promise.resolve(), { pruneIdleMs: 10 });
      try {
        await new Promise((resolve) => setTimeout(resolve, 30));
        assert.deepEqual(await worker.pruneConsumers(), ["ghost"], "named once for the lane");
        for (const stream of [high, low]) {
          const consumers = await r.redis.call("XINFO", "CONSUMERS", stream, "g") as unknown[][];
          assert.ok(!consumers.some((c) => c[1] === "ghost"), `${stream}: ghost removed`);
        }
      } finally {
        await worker.close();
        await registry.close();
      }
    });
  } finally {
    await r.close();
  }
});
