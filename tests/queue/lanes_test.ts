/**
 * Lanes: one stream per tenant, shared fairly by one worker's slots. The
 * assertions are about order and counts (which lane's messages completed
 * when), never about elapsed time.
 */
import assert from "node:assert/strict";
import { announceLane, createLaneRegistry, laneRegistryKeys } from "../../src/queue/lanes.ts";
import type { QueueNames } from "../../src/queue/message.ts";
import { createStreamWorker, type MessageHandler } from "../../src/queue/stream_worker.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { sleep } from "../../src/async/timeout.ts";
import { createTestRedis, waitFor } from "../_support.ts";

Deno.test("lanes", async (t) => {
  const r = await createTestRedis();
  let run = 0;
  const setup = (extra: QueueNames[] = []) => {
    const prefix = `${r.prefix}:run${run++}`;
    const keys = laneRegistryKeys(prefix);
    const lane = (id: string): QueueNames => ({
      stream: `${prefix}:{t:${id}}:stream`,
      dead: `${prefix}:{t:${id}}:dead`,
      group: "g",
    });
    const registry = createLaneRegistry({ redis: r.redis, log: silentLogger }, { keys, lane, extra });
    const enqueue = async (id: string, n: number) => {
      for (let i = 0; i < n; i++) await r.redis.xadd(lane(id).stream, "*", "job_id", `${id}-${i}`, "tenant", id);
      await announceLane(r.redis, keys, id);
    };
    const workerWith = (handler: MessageHandler, overrides: Record<string, unknown> = {}) =>
      createStreamWorker({ redis: r.redis, log: silentLogger }, {
        stream: "unused",
        dead: "unused",
        group: "g",
        consumer: "w",
        claimIdleMs: 60_000,
        maxDeliveries: 5,
        concurrency: 4,
        blockMs: 20,
        lanes: registry,
        ...overrides,
      }, handler);
    return { prefix, keys, lane, registry, enqueue, workerWith };
  };

  try {
    await t.step("a tenant's backlog does not stall another: B's jobs interleave as soon as they arrive", async () => {
      const { registry, enqueue, workerWith } = setup();
      const done: string[] = [];
      const worker = workerWith(async (m) => {
        await sleep(15);
        done.push(m.fields.tenant!);
      });
      const stop = new AbortController();
      const running = worker.run(stop.signal);
      try {
        await enqueue("a", 60);
        await waitFor("A under way", () => done.length >= 4);
        const before = done.length;
        await enqueue("b", 8);
        await waitFor("all of B", () => done.filter((x) => x === "b").length === 8, 10_000);
        // With two lanes, every freed slot alternates: B's 8 finish within about 16 completions of
        // their arrival (plus the 4 A jobs already running), long before A's 60 are done.
        const lastB = done.lastIndexOf("b");
        assert.ok(lastB - before <= 16 + 4 + 2, `B's last job was completion ${lastB}, ${before} after A began`);
        assert.ok(done.filter((x) => x === "a").length < 40, "A still had a backlog when B was done");
      } finally {
        stop.abort();
        await running;
        await worker.close();
        await registry.close();
      }
    });

    await t.step("with equal backlogs, two tenants progress at rates within 10% of each other", async () => {
      const { registry, enqueue, workerWith } = setup();
      const done: string[] = [];
      const worker = workerWith(async (m) => {
        await sleep(5);
        done.push(m.fields.tenant!);
      });
      await enqueue("a", 60);
      await enqueue("b", 60);
      const stop = new AbortController();
      const running = worker.run(stop.signal);
      try {
        await waitFor("60 completions", () => done.length >= 60, 10_000);
        const first60 = done.slice(0, 60);
        const a = first60.filter((x) => x === "a").length;
        const b = first60.length - a;
        assert.ok(Math.abs(a - b) <= 6, `a ${a}, b ${b} of the first 60`);
      } finally {
        stop.abort();
        await running;
        await worker.close();
        await registry.close();
      }
    });

    await t.step("TENANT_MAX_IN_FLIGHT caps one lane's pending messages; the other lane still runs", async () => {
      const { registry, enqueue, workerWith, lane } = setup();
      const release: (() => void)[] = [];
      const seen: string[] = [];
      const worker = workerWith((m) => {
        seen.push(m.fields.tenant!);
        return new Promise<void>((res) => release.push(res));
      }, { concurrency: 8, laneMaxInFlight: 2 });
      await enqueue("a", 10);
      await enqueue("b", 1);
      await worker.runOnce(0);
      await worker.runOnce(0);
      assert.equal(seen.filter((x) => x === "a").length, 2, "only two of A's jobs in flight");
      assert.equal(seen.filter((x) => x === "b").length, 1);
      const [pendingA] = await r.redis.xpending(lane("a").stream, "g") as [number];
      assert.equal(pendingA, 2);
      for (const res of release) res();
      await worker.drain();
      await worker.close();
      await registry.close();
    });

    await t.step("a capped lane does not leave a free slot idle while another lane has work", async () => {
      const { registry, enqueue, workerWith } = setup();
      const release = new Map<string, () => void>();
      const seen: string[] = [];
      const worker = workerWith((m) => {
        seen.push(m.fields.job_id!);
        return new Promise<void>((res) => release.set(m.fields.job_id!, res));
      }, { concurrency: 2, laneMaxInFlight: 1 });
      await enqueue("a", 5);
      await enqueue("b", 5);
      assert.equal(await worker.runOnce(0), 2); // a-0 and b-0
      release.get("b-0")!();
      await waitFor("b-0 acked", () => worker.inFlight === 1);
      assert.equal(await worker.runOnce(0), 1); // b-1: the turn starts after a
      release.get("b-1")!();
      await waitFor("b-1 acked", () => worker.inFlight === 1);
      // Now the turn starts at a, which is at its cap with a-0 running: the slot goes to b.
      assert.equal(await worker.runOnce(0), 1);
      assert.deepEqual(seen, ["a-0", "b-0", "b-1", "b-2"]);
      for (const res of release.values()) res();
      await worker.drain();
      await worker.close();
      await registry.close();
    });

    await t.step(
      "an empty lane leaves the active set; work arriving meanwhile puts it back; the sweep repairs",
      async () => {
        const { keys, registry, enqueue, workerWith, lane } = setup();
        const worker = workerWith(() => Promise.resolve());
        await enqueue("a", 1);
        await worker.runOnce(0);
        await worker.drain();
        await worker.runOnce(0); // finds A empty
        assert.deepEqual(await r.redis.smembers(keys.active), []);
        // A producer that crashed between its enqueue and its announcement: only the sweep finds the lane.
        await r.redis.sadd(keys.all, "c");
        await r.redis.xadd(lane("c").stream, "*", "job_id", "c-0", "tenant", "c");
        await r.redis.xgroup("CREATE", lane("c").stream, "g", "0");
        assert.equal(await registry.sweep(), 1);
        assert.deepEqual(await r.redis.smembers(keys.active), ["c"]);
        // An idle check that races a new message re-adds the lane.
        await r.redis.xadd(lane("a").stream, "*", "job_id", "a-1", "tenant", "a");
        await registry.idle(lane("a"));
        assert.ok((await r.redis.smembers(keys.active)).includes("a"));
        await worker.close();
        await registry.close();
      },
    );

    await t.step("an idle worker is woken by the publish after an enqueue, not by its poll", async () => {
      const { registry, enqueue } = setup();
      await registry.active(); // subscribed
      let woke = false;
      const waiting = registry.wait(60_000).then(() => (woke = true));
      await enqueue("a", 1);
      await Promise.race([waiting, sleep(5_000)]);
      assert.equal(woke, true);
      await registry.close();
    });

    await t.step("a lane outside the registry (the pre-lane stream) is read until it is empty", async () => {
      const legacy: QueueNames = { stream: `${r.prefix}:{jobs}:stream`, dead: `${r.prefix}:{jobs}:dead`, group: "g" };
      for (let i = 0; i < 3; i++) await r.redis.xadd(legacy.stream, "*", "job_id", `old-${i}`, "tenant", "x");
      const { registry, workerWith } = setup([legacy]);
      const done: string[] = [];
      const worker = workerWith((m) => (done.push(m.fields.job_id!), Promise.resolve()));
      await worker.runOnce(0);
      await worker.drain();
      await worker.runOnce(0);
      assert.deepEqual(done.sort(), ["old-0", "old-1", "old-2"]);
      assert.equal((await registry.active()).length, 0, "drained, so no longer read");
      // A message that lands there later (a replay, an older API during an upgrade) is read within a second.
      await r.redis.xadd(legacy.stream, "*", "job_id", "old-3", "tenant", "x");
      await waitFor("the late message", async () => {
        await worker.runOnce(0);
        await worker.drain();
        return done.includes("old-3");
      }, 5_000);
      await worker.close();
      await registry.close();
    });
  } finally {
    await r.close();
  }
});
