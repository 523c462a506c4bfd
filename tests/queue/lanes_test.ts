/**
 * Lanes: a group on one stream per tenant here, shared fairly by one worker's slots. The
 * assertions are about order and counts (which lane's messages completed
 * when), never about elapsed time.
 */
import assert from "node:assert/strict";
import {
  announceLane,
  createLaneRegistry,
  createLaneShares,
  type LaneCharge,
  laneRegistryKeys,
} from "../../src/queue/lanes.ts";
import type { LaneNames, QueueNames, StreamMessage } from "../../src/queue/message.ts";
import { createReadAhead, createStreamWorker, type MessageHandler } from "../../src/queue/stream_worker.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { sleep } from "../../src/async/timeout.ts";
import { createTestRedis, waitFor } from "../_support.ts";

Deno.test("lanes", async (t) => {
  const r = await createTestRedis();
  let run = 0;
  const setup = () => {
    const prefix = `${r.prefix}:run${run++}`;
    const keys = laneRegistryKeys(prefix);
    const lane = (id: string): QueueNames & LaneNames => ({
      stream: `${prefix}:{t:${id}}:stream`,
      streams: [`${prefix}:{t:${id}}:stream`],
      dead: `${prefix}:{t:${id}}:dead`,
      group: "g",
    });
    const registry = createLaneRegistry({ redis: r.redis, log: silentLogger }, { keys, lane });
    const enqueue = async (id: string, n: number) => {
      for (let i = 0; i < n; i++) await r.redis.xadd(lane(id).stream, "*", "job_id", `${id}-${i}`, "tenant", id);
      await announceLane(r.redis, keys, id);
    };
    const workerWith = (handler: MessageHandler, overrides: Record<string, unknown> = {}) =>
      createStreamWorker({ redis: r.redis, log: silentLogger }, {
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

  /** Runs a one-slot `worker` `n` times, each message finished before the next read: service in order. */
  const oneByOne = async (worker: { runOnce(block?: number): Promise<number>; drain(): Promise<void> }, n: number) => {
    for (let i = 0; i < n; i++) {
      assert.equal(await worker.runOnce(0), 1);
      await worker.drain();
    }
  };
  const count = (list: string[], x: string) => list.filter((y) => y === x).length;

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
        // B takes freed slots until it holds as many as A, then they alternate: B's 8 finish within
        // about 16 completions of their arrival (plus the 4 A jobs already running), long before A's 60.
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
      // a-0 and b-0, in the order the worker learned of the lanes (their wake-ups: on a cluster either may come
      // first).
      assert.equal(await worker.runOnce(0), 2);
      assert.deepEqual([...seen].sort(), ["a-0", "b-0"]);
      release.get("b-0")!();
      await waitFor("b-0 acked", () => worker.inFlight === 1);
      // a is at its cap with a-0 running, whichever lane's turn it is: the slot goes to b, twice.
      assert.equal(await worker.runOnce(0), 1);
      release.get("b-1")!();
      await waitFor("b-1 acked", () => worker.inFlight === 1);
      assert.equal(await worker.runOnce(0), 1);
      assert.deepEqual(seen.slice(2), ["b-1", "b-2"]);
      for (const res of release.values()) res();
      await worker.drain();
      await worker.close();
      await registry.close();
    });

    await t.step("a lane that becomes active takes freed slots until it holds as many as the busy lane", async () => {
      const { registry, enqueue, workerWith } = setup();
      const release: (() => void)[] = [];
      const started: string[] = [];
      const worker = workerWith((m) => {
        started.push(m.fields.tenant!);
        return new Promise<void>((res) => release.push(res));
      });
      await enqueue("a", 20);
      assert.equal(await worker.runOnce(0), 4);
      // B's jobs arrive (the worker learns of them from the wake-up) while A has four running and none finished:
      // B starts level with A's finished service, four behind A.
      const woken = registry.wait(5_000);
      await enqueue("b", 8);
      await woken;
      // Two of A's four finish: both freed slots go to B, which holds nothing yet.
      release.shift()!();
      release.shift()!();
      await waitFor("two slots free", () => worker.inFlight === 2);
      assert.equal(await worker.runOnce(0), 2);
      assert.deepEqual(started.slice(4), ["b", "b"]);
      // The other two finish: B has had two, A four: both go to B, which now holds as many as A had running.
      release.shift()!();
      release.shift()!();
      await waitFor("two slots free", () => worker.inFlight === 2);
      assert.equal(await worker.runOnce(0), 2);
      assert.deepEqual(started.slice(6), ["b", "b"]);
      // Level now: the next two, one each.
      release.shift()!();
      release.shift()!();
      await waitFor("two slots free", () => worker.inFlight === 2);
      assert.equal(await worker.runOnce(0), 2);
      assert.deepEqual(started.slice(8).sort(), ["a", "b"]);
      for (const res of release) res();
      await worker.drain();
      await worker.close();
      await registry.close();
    });

    /**
     * A worker of two slots whose handlers call `finishing` when the test ends their model part, then wait for the
     * test to end their commit: so messages are read ahead (one per handler committing without its slot).
     */
    const twoSlots = (workerWith: ReturnType<typeof setup>["workerWith"], overrides: Record<string, unknown> = {}) => {
      const started: string[] = [];
      const model = new Map<string, () => void>();
      const commit = new Map<string, () => void>();
      const committing: string[] = [];
      const worker = workerWith(async (m, _signal, finishing) => {
        const id = m.fields.job_id!;
        started.push(id);
        await new Promise<void>((res) => model.set(id, res));
        finishing();
        committing.push(id);
        await new Promise<void>((res) => commit.set(id, res));
      }, { concurrency: 2, ...overrides });
      /** Ends `id`'s model part and waits until it commits (its slot freed, or kept). */
      const modelDone = async (id: string) => {
        await waitFor(`${id} started`, () => model.has(id));
        model.get(id)!();
        await waitFor(`${id} committing`, () => committing.includes(id));
      };
      /** Ends every handler, the ones read ahead too, and waits for them. */
      const finishAll = async () => {
        for (let i = 0; i < 100 && commit.size < started.length; i++) {
          for (const go of model.values()) go();
          await sleep(5);
        }
        for (let i = 0; i < 200 && worker.inFlight > 0; i++) {
          for (const go of [...model.values(), ...commit.values()]) go();
          await worker.runOnce(0);
          await sleep(5);
        }
        await worker.drain();
      };
      return { worker, started, modelDone, commit, finishAll };
    };

    await t.step(
      "a tenant whose first job came while every slot was busy goes before the messages read ahead",
      async () => {
        const { registry, enqueue, workerWith } = setup();
        const { worker, started, modelDone, commit, finishAll } = twoSlots(workerWith);
        try {
          await enqueue("a", 8);
          assert.equal(await worker.runOnce(0), 2);
          await modelDone("a-0");
          await modelDone("a-1");
          // a-0 and a-1 commit without their slots: a-2 and a-3 take them, a-4 and a-5 are read ahead.
          assert.equal(await worker.runOnce(0), 4);
          assert.deepEqual(started, ["a-0", "a-1", "a-2", "a-3"]);
          // B's jobs arrive while both slots are busy; the worker learns of them from the wake-up, without a read.
          const woken = registry.wait(5_000);
          await enqueue("b", 2);
          await woken;
          commit.get("a-0")!();
          await modelDone("a-2");
          // a-2's slot is free, but B is due before a-4 (it holds nothing): the slot waits for the next read.
          assert.deepEqual(started, ["a-0", "a-1", "a-2", "a-3"]);
          assert.equal(await worker.runOnce(0), 1);
          assert.deepEqual(started.slice(4), ["b-0"]);
          commit.get("a-1")!();
          await modelDone("a-3");
          assert.equal(await worker.runOnce(0), 1);
          assert.deepEqual(started.slice(4), ["b-0", "b-1"]);
          // B has nothing left: the next slot goes to what was read ahead, in its order.
          commit.get("a-2")!();
          await modelDone("b-0");
          assert.deepEqual(started.slice(4), ["b-0", "b-1", "a-4"]);
          await finishAll();
          assert.deepEqual(
            [...started].sort(),
            [...Array.from({ length: 8 }, (_, i) => `a-${i}`), "b-0", "b-1"].sort(),
          );
        } finally {
          await worker.close();
          await registry.close();
        }
      },
    );

    await t.step(
      "a message read ahead before costs were known is due again once the messages before it settle at their real cost",
      async () => {
        const { registry, enqueue, workerWith } = setup();
        // Estimated at 1,000 and really costing 1: the worker's first messages are charged 1,000 each, all of them
        // before one has settled, so H's messages read ahead carry start tags of 4,000 and 5,000.
        const { worker, started, modelDone, commit, finishAll } = twoSlots(workerWith, {
          cost: () => 1_000,
          spent: () => 1,
        });
        /** Ends `id`'s commit and waits until it has settled. */
        const finish = async (id: string) => {
          const before = worker.inFlight;
          commit.get(id)!();
          await waitFor(`${id} settled`, () => worker.inFlight < before);
        };
        try {
          await enqueue("h", 8);
          assert.equal(await worker.runOnce(0), 2);
          await modelDone("h-0");
          await modelDone("h-1");
          assert.equal(await worker.runOnce(0), 4);
          assert.deepEqual(started, ["h-0", "h-1", "h-2", "h-3"], "h-4 and h-5 are read ahead");
          const woken = registry.wait(5_000);
          await enqueue("l", 30);
          await woken;
          await finish("h-0");
          await finish("h-1");
          // Each round the oldest job running ends: L, at the clock and charged 1 a message now, takes the freed
          // slot while it is due before h-4; h-4 is due once H's messages before it have settled at 1 each.
          const ended = new Set(["h-0", "h-1"]);
          for (let i = 0; i < 40 && !started.includes("h-4"); i++) {
            const id = started.find((x) => !ended.has(x))!;
            await modelDone(id);
            await finish(id);
            ended.add(id);
            if (!started.includes("h-4")) await worker.runOnce(0);
          }
          const lFirst = started.slice(0, started.indexOf("h-4")).filter((x) => x.startsWith("l-")).length;
          // Before: h-4 waited behind every one of L's 30 (its start tag stayed at 4,000 while L's ran at 1 each).
          // L went first while it was due (the wake-up had made it known), and only while it was.
          assert.ok(
            started.includes("h-4") && lFirst >= 1 && lFirst <= 6,
            `L's jobs before h-4: ${lFirst} (${started.join(" ")})`,
          );
          await finishAll();
        } finally {
          await worker.close();
          await registry.close();
        }
      },
    );

    await t.step(
      "a lane woken with nothing in it holds no slot: the read finds it empty, the one read ahead starts",
      async () => {
        const { registry, keys, enqueue, workerWith } = setup();
        const { worker, started, modelDone, commit, finishAll } = twoSlots(workerWith);
        try {
          await enqueue("a", 6);
          assert.equal(await worker.runOnce(0), 2);
          await modelDone("a-0");
          await modelDone("a-1");
          assert.equal(await worker.runOnce(0), 4);
          const woken = registry.wait(5_000);
          await announceLane(r.redis, keys, "empty");
          await woken;
          commit.get("a-0")!();
          await modelDone("a-2");
          assert.deepEqual(started, ["a-0", "a-1", "a-2", "a-3"], "the freed slot waits for the read");
          // The read finds the woken lane empty and A drained (its last two are read ahead already): none taken, so
          // the message read ahead takes the slot.
          assert.equal(await worker.runOnce(0), 0);
          assert.deepEqual(started, ["a-0", "a-1", "a-2", "a-3", "a-4"]);
          await finishAll();
          assert.equal(started.length, 6);
        } finally {
          await worker.close();
          await registry.close();
        }
      },
    );

    await t.step(
      "with every slot busy and messages read ahead, a read that finds nothing waits for a wake-up",
      async () => {
        const { registry, enqueue, workerWith } = setup();
        const { worker, started, modelDone, finishAll } = twoSlots(workerWith);
        try {
          await enqueue("a", 5);
          assert.equal(await worker.runOnce(0), 2);
          await modelDone("a-0");
          await modelDone("a-1");
          // a-2 and a-3 take the slots, a-4 is read ahead: one more may be read for the two committing.
          assert.equal(await worker.runOnce(0), 3);
          assert.deepEqual(started, ["a-0", "a-1", "a-2", "a-3"]);
          // No slot is held back (both are busy), so the read blocks as usual rather than spinning.
          const before = performance.now();
          assert.equal(await worker.runOnce(300), 0);
          const waited = performance.now() - before;
          assert.ok(waited >= 250, `returned after ${waited.toFixed(0)} ms`);
          await finishAll();
        } finally {
          await worker.close();
          await registry.close();
        }
      },
    );

    await t.step(
      "shares follow cost: messages costing 4 are served a quarter as often as messages costing 1",
      async () => {
        const { registry, lane, keys, workerWith } = setup();
        for (let i = 0; i < 60; i++) {
          await r.redis.xadd(lane("a").stream, "*", "job_id", `a-${i}`, "tenant", "a", "cost", "4");
          await r.redis.xadd(lane("b").stream, "*", "job_id", `b-${i}`, "tenant", "b", "cost", "1");
        }
        await announceLane(r.redis, keys, "a");
        await announceLane(r.redis, keys, "b");
        const served: string[] = [];
        const worker = workerWith((m) => (served.push(m.fields.tenant!), Promise.resolve()), {
          concurrency: 1,
          cost: (m: StreamMessage) => Number(m.fields.cost),
        });
        await oneByOne(worker, 50);
        assert.equal(count(served, "a"), 10, served.join(""));
        assert.equal(count(served, "b"), 40);
        await worker.close();
        await registry.close();
      },
    );

    await t.step("what a message really cost replaces its estimate in its lane's share", async () => {
      const { registry, lane, keys, workerWith } = setup();
      for (let i = 0; i < 30; i++) {
        await r.redis.xadd(lane("a").stream, "*", "job_id", `a-${i}`, "tenant", "a", "cost", "4", "spent", "1");
        await r.redis.xadd(lane("b").stream, "*", "job_id", `b-${i}`, "tenant", "b", "cost", "1", "spent", "1");
      }
      await announceLane(r.redis, keys, "a");
      await announceLane(r.redis, keys, "b");
      const served: string[] = [];
      const worker = workerWith((m) => (served.push(m.fields.tenant!), Promise.resolve()), {
        concurrency: 1,
        cost: (m: StreamMessage) => Number(m.fields.cost),
        spent: (m: StreamMessage) => Number(m.fields.spent),
      });
      await oneByOne(worker, 40);
      // Estimated at 4, A's messages cost 1 like B's: the two lanes are served alike.
      assert.ok(Math.abs(count(served, "a") - count(served, "b")) <= 4, served.join(""));
      await worker.close();
      await registry.close();
    });

    await t.step("weight 3 against weight 1, equal costs and backlogs: served 3:1", async () => {
      const { registry, enqueue, workerWith } = setup();
      await enqueue("a", 60);
      await enqueue("b", 60);
      const served: string[] = [];
      const worker = workerWith((m) => (served.push(m.fields.tenant!), Promise.resolve()), {
        concurrency: 1,
        weights: () => Promise.resolve((l: LaneNames) => (l.streams[0]!.includes("{t:a}") ? 3 : 1)),
      });
      await oneByOne(worker, 40);
      assert.equal(count(served, "a"), 30, served.join(""));
      assert.equal(count(served, "b"), 10);
      await worker.close();
      await registry.close();
    });

    await t.step("a lane back from idle starts level with the others: it banked no credit while idle", async () => {
      const { registry, enqueue, workerWith } = setup();
      const served: string[] = [];
      const worker = workerWith((m) => (served.push(m.fields.tenant!), Promise.resolve()), { concurrency: 1 });
      await enqueue("b", 2);
      await enqueue("a", 60);
      await oneByOne(worker, 40); // B's two, then A alone
      assert.equal(count(served, "b"), 2);
      await enqueue("b", 20);
      served.length = 0;
      await oneByOne(worker, 10);
      // A lane starting from where it stopped would take all ten; level with A, it takes its turn.
      assert.ok(count(served, "b") <= 6, served.join(""));
      assert.ok(count(served, "b") >= 4, served.join(""));
      await worker.close();
      await registry.close();
    });

    await t.step("a lane alone gets every free slot, whatever its cost and weight", async () => {
      const { registry, enqueue, workerWith } = setup();
      const release: (() => void)[] = [];
      const worker = workerWith(() => new Promise<void>((res) => release.push(res)), {
        concurrency: 8,
        cost: () => 100_000,
        weights: () => Promise.resolve(() => 1),
      });
      await enqueue("a", 20);
      assert.equal(await worker.runOnce(0), 8);
      for (const res of release) res();
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
        await registry.idle([lane("a")]);
        assert.ok((await r.redis.smembers(keys.active)).includes("a"));
        await worker.close();
        await registry.close();
      },
    );

    await t.step("one wake-up naming several lanes (an intake call's) brings each of them as news", async () => {
      const { registry, keys, lane } = setup();
      await registry.active(); // subscribed
      const waiting = registry.wait(60_000);
      // As the intake script publishes the lanes of one call; none of them is in the sets the walk reads.
      await r.redis.publish(keys.wake, "x y z");
      await Promise.race([waiting, sleep(5_000)]);
      assert.deepEqual(
        (await registry.active()).map((l) => l.streams[0]),
        ["x", "y", "z"].map((id) => lane(id).stream),
      );
      await registry.close();
    });

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
  } finally {
    await r.close();
  }
});

Deno.test("lane shares: charged at the expected cost, settled at the real one; newcomers start at the clock", () => {
  const shares = createLaneShares();
  shares.activate("a", 1);
  // Nothing known yet: the estimate is charged, then settled to what the message really cost.
  const first = shares.charge("a", 1_000);
  assert.equal(shares.finish("a"), 1_000);
  shares.settle(first, 100);
  assert.equal(shares.finish("a"), 100);
  // Now A's messages are expected to cost a tenth of their estimates.
  const running = [shares.charge("a", 1_000), shares.charge("a", 1_000)];
  assert.equal(shares.finish("a"), 300);
  // B arrives while two of A's run: it starts at A's finished service, 100, behind A by what A has running.
  shares.activate("b", 1);
  assert.equal(shares.finish("b"), 100);
  assert.equal(shares.plan(2)[0]!.lane, "b");
  // Unknown cost (no usage reported): the estimate stands. A call never made costs nothing.
  shares.settle(running[0]!, undefined);
  assert.equal(shares.finish("a"), 1_200);
  shares.settle(running[1]!, 0);
  assert.equal(shares.finish("a"), 1_100);
});

Deno.test("lane shares: a charge's start tag moves by the corrections its lane settles after it was charged", () => {
  const shares = createLaneShares();
  shares.activate("h", 1);
  // Nothing known yet: three of H's messages charged 1,000 each; the third waits read ahead.
  const [h0, h1, h2] = [shares.charge("h", 1_000), shares.charge("h", 1_000), shares.charge("h", 1_000)];
  assert.equal(h2!.start, 2_000);
  // L comes at the clock (0) and runs a message; it is due before h2 until H's first two settle.
  shares.activate("l", 1);
  shares.settle(shares.charge("l", 1_000), 1);
  assert.equal(shares.behind(h2!), true);
  shares.settle(h0!, 1);
  shares.settle(h1!, 1);
  // H's first two really cost 1 each: h2 is due at 2, and L (finish 1, charged 1 a message now) before it.
  assert.equal(shares.startOf(h2!), 2);
  assert.equal(shares.behind(h2!), true);
  shares.charge("l", 1_000);
  shares.charge("l", 1_000);
  assert.equal(shares.finish("l"), 3);
  assert.equal(shares.behind(h2!), false, "L is past h2's start now");
  // A charge taken after the corrections moves only by those that come after it.
  const h3 = shares.charge("h", 1_000);
  assert.equal(shares.startOf(h3), shares.finish("h")! - h3.weighted);
  const before = shares.startOf(h3);
  shares.settle(h2!, 1);
  assert.equal(shares.startOf(h3), before - (1_000 - 1));
});

Deno.test("read ahead: the next to start is the lane whose tag is earliest now, whichever lane was read first", () => {
  const shares = createLaneShares();
  shares.activate("x", 1);
  shares.activate("h", 1);
  // Nothing known yet: X's and H's first two each charged 1,000; the second of each waits read ahead, X's first.
  const [x0, x1] = [shares.charge("x", 1_000), shares.charge("x", 1_000)];
  const [h0, h1] = [shares.charge("h", 1_000), shares.charge("h", 1_000)];
  const started: string[] = [];
  const readAhead = createReadAhead(shares);
  const entry = (name: string, charge: LaneCharge) => ({
    stream: { stream: name, dead: "d", group: "g" },
    message: { id: name, fields: {}, deliveries: 1 },
    charge,
    start: () => void started.push(name),
    abandon() {},
  });
  readAhead.push(entry("x1", x1!));
  readAhead.push(entry("h1", h1!));
  // H's first settles at its real cost (1): h1 is due at 1. X's first is still running: x1 stays at 1,000.
  shares.settle(h0!, 1);
  assert.equal(shares.startOf(h1!), 1);
  assert.equal(shares.startOf(x1!), 1_000);
  // L comes, runs one job (charged 1 now) and is due at 2: before x1, not before h1.
  shares.activate("l", 1);
  shares.charge("l", 1_000);
  let free = 1;
  readAhead.start(() => free-- > 0, false);
  assert.deepEqual(started, ["h1"], "h1 takes the slot; x1 waits for L");
  // x1 still waits: L is due before it.
  free = 1;
  readAhead.start(() => free > 0, false);
  assert.deepEqual(started, ["h1"]);
  assert.equal(readAhead.length, 1);
  shares.settle(x0!, 1);
  readAhead.start(() => free-- > 0, false);
  assert.deepEqual(started, ["h1", "x1"], "once X's first settles, x1 is due at 1 and starts");
});
