import assert from "node:assert/strict";
import { listDeadLetters, replayDeadLetter } from "../../src/queue/dead_letter.ts";
import { PermanentJobError } from "../../src/queue/errors.ts";
import type { StreamMessage } from "../../src/queue/message.ts";
import { createStreamWorker, ensureGroup, type MessageHandler } from "../../src/queue/stream_worker.ts";
import { staticLanes } from "../../src/queue/static_lanes.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { settlesWithin } from "../../src/async/timeout.ts";
import { createTestRedis, type TestRedis, waitFor } from "../_support.ts";

/** A lane of one stream: its names as a lane and as that stream's. */
function names(prefix: string) {
  const stream = `${prefix}:{q}:stream`;
  return { stream, streams: [stream], dead: `${prefix}:{q}:dead`, group: "g" };
}

function worker(r: TestRedis, consumer: string, handler: MessageHandler, overrides: Record<string, unknown> = {}) {
  return createStreamWorker({ redis: r.redis, log: silentLogger }, {
    // One lane, reclaimed on every pass: the tests step the worker with runOnce.
    lanes: staticLanes([names(r.prefix)]),
    reclaimIntervalMs: 0,
    consumer,
    claimIdleMs: 60_000,
    maxDeliveries: 5,
    concurrency: 8,
    blockMs: 10,
    ...overrides,
  }, handler);
}

async function pendingOf(r: TestRedis) {
  const n = names(r.prefix);
  return await r.redis.xpending(n.stream, n.group, "-", "+", 100) as [string, string, number, number][];
}

function gate() {
  let open!: () => void;
  const opened = new Promise<void>((r) => (open = r));
  return { open, opened };
}

Deno.test("stream worker", async (t) => {
  const r = await createTestRedis();
  const n = names(r.prefix);
  const add = (fields: Record<string, string> = { job_id: "j", tenant: "acme" }) =>
    r.redis.xadd(n.stream, "*", ...Object.entries(fields).flat()) as Promise<string>;
  const reset = async () => {
    await r.redis.del(n.stream, n.dead);
    await ensureGroup(r.redis, n);
  };

  try {
    await t.step("runs up to `concurrency` handlers at once and reads more as slots free up", async () => {
      await reset();
      for (let i = 0; i < 12; i++) await add();
      let running = 0, peak = 0, done = 0;
      const g = gate();
      const w = worker(r, "c1", async () => {
        running++;
        peak = Math.max(peak, running);
        await g.opened;
        running--;
        done++;
      }, { concurrency: 5 });
      try {
        assert.equal(await w.runOnce(), 5);
        assert.equal(await w.runOnce(), 0, "no free slot, nothing read");
        assert.equal(w.inFlight, 5);
        g.open();
        await w.drain();
        assert.equal(await w.runOnce(), 5);
        await w.drain();
        assert.equal(await w.runOnce(), 2);
        await w.drain();
        assert.equal(peak, 5);
        assert.equal(done, 12);
        assert.equal((await pendingOf(r)).length, 0);
      } finally {
        await w.close();
      }
    });

    await t.step("acked entries are deleted: after 5,000 jobs the stream holds only what is pending", async () => {
      await reset();
      const pipeline = r.redis.pipeline();
      for (let i = 0; i < 5000; i++) pipeline.xadd(n.stream, "*", "job_id", String(i), "tenant", "acme");
      await pipeline.exec();
      let handled = 0;
      const w = worker(r, "c1", () => {
        handled++;
        return Promise.resolve();
      }, { concurrency: 256 });
      const stop = new AbortController();
      const running = w.run(stop.signal);
      try {
        await waitFor("5000 handled", () => handled === 5000, 30_000);
        await waitFor("acks", async () => (await pendingOf(r)).length === 0);
        assert.equal(await r.redis.xlen(n.stream), 0);
      } finally {
        stop.abort();
        await running;
        await w.close();
      }
    });

    await t.step(
      "a consumer killed after XREADGROUP: not claimable before claimIdleMs, then claimed with 2 deliveries",
      async () => {
        await reset();
        const id = await add();
        const dead = worker(r, "killed", () => new Promise(() => {}), { claimIdleMs: 300 });
        await dead.runOnce();
        await dead.close(); // killed: no heartbeat, no ack
        const seen: StreamMessage[] = [];
        const survivor = worker(r, "survivor", (m) => {
          seen.push(m);
          return Promise.resolve();
        }, { claimIdleMs: 300 });
        try {
          assert.equal(await survivor.runOnce(0), 0, "not claimable while idle < claimIdleMs");
          assert.equal(seen.length, 0);
          await new Promise((res) => setTimeout(res, 350));
          assert.equal(await survivor.runOnce(0), 1);
          await survivor.drain();
          assert.equal(seen[0]!.id, id);
          assert.equal(seen[0]!.deliveries, 2);
          assert.equal((await pendingOf(r)).length, 0);
        } finally {
          await survivor.close();
        }
      },
    );

    await t.step(
      "reclaimed messages get their own delivery counts even around this consumer's in-flight ones",
      async () => {
        await reset();
        const b = await add({ job_id: "b", tenant: "acme" });
        const c = await add({ job_id: "c", tenant: "acme" });
        await r.redis.xreadgroup("GROUP", n.group, "dead", "COUNT", 1, "STREAMS", n.stream, ">"); // b: 1 delivery
        const seen = new Map<string, number>();
        const w = worker(r, "w", (m) => {
          seen.set(m.id, m.deliveries);
          return m.id === c ? new Promise(() => {}) : Promise.resolve();
        }, { claimIdleMs: 50, concurrency: 8 });
        try {
          await w.runOnce(0); // c is in flight from here on, between b and d
          const d = await add({ job_id: "d", tenant: "acme" });
          await r.redis.xreadgroup("GROUP", n.group, "dead", "COUNT", 1, "STREAMS", n.stream, ">"); // d: 1
          await r.redis.xclaim(n.stream, n.group, "dead", 0, d); // d: 2 deliveries
          await new Promise((res) => setTimeout(res, 80));
          assert.equal(await w.runOnce(0), 2, "b and d reclaimed; c is already running here");
          await new Promise((res) => setTimeout(res, 20));
          assert.equal(seen.get(b), 2);
          assert.equal(seen.get(d), 3);
        } finally {
          await w.close();
        }
      },
    );

    await t.step("heartbeat: a job running 3x claimIdleMs is not reclaimed from a live worker", async () => {
      await reset();
      await add();
      let calls = 0;
      const live = worker(r, "live", async () => {
        calls++;
        await new Promise((res) => setTimeout(res, 900));
      }, { claimIdleMs: 300, heartbeatMs: 75 });
      const rival = worker(r, "rival", () => {
        calls++;
        return Promise.resolve();
      }, { claimIdleMs: 300 });
      const stop = new AbortController();
      const running = live.run(stop.signal);
      try {
        await waitFor("live took it", () => calls === 1);
        const end = performance.now() + 1_000;
        while (performance.now() < end) {
          await rival.runOnce(0);
          await new Promise((res) => setTimeout(res, 50));
        }
        await rival.drain();
        assert.equal(calls, 1, "the rival never ran it");
        assert.equal((await pendingOf(r)).length, 0, "the live worker acked it");
      } finally {
        stop.abort();
        await running;
        await live.close();
        await rival.close();
      }
    });

    await t.step("heartbeat: a stalled worker never steals back a message another worker reclaimed", async () => {
      await reset();
      const id = await add();
      const g = gate();
      const stalled = worker(r, "stalled", () => g.opened, { claimIdleMs: 100 });
      const rescuer = worker(r, "rescuer", () => new Promise(() => {}), { claimIdleMs: 100 });
      try {
        await stalled.runOnce(0); // in flight, but its heartbeat never runs (stalled)
        await new Promise((res) => setTimeout(res, 150));
        assert.equal(await rescuer.runOnce(0), 1);
        assert.deepEqual(await stalled.heartbeat(), [], "the stalled worker refreshes nothing it lost");
        const [entry] = await pendingOf(r);
        assert.deepEqual([entry![0], entry![1], entry![3]], [id, "rescuer", 2], "still the rescuer's, count unchanged");
        assert.deepEqual(await rescuer.heartbeat(), [id], "the owner's heartbeat refreshes it");
        const [after] = await pendingOf(r);
        assert.equal(after![3], 2, "JUSTID refresh does not bump the delivery count");
      } finally {
        g.open();
        await stalled.drain();
        await stalled.close();
        await rescuer.close();
      }
    });

    await t.step("an always-failing handler runs maxDeliveries times and the next claim dead-letters it", async () => {
      await reset();
      const id = await add({ job_id: "j-fail", tenant: "acme", payload: "{}" });
      let calls = 0;
      const w = worker(r, "c1", () => {
        calls++;
        return Promise.reject(new Error("transient"));
      }, { claimIdleMs: 0, maxDeliveries: 3 });
      try {
        for (let i = 0; i < 4; i++) {
          await w.runOnce(0);
          await w.drain();
        }
        assert.equal(calls, 3);
        assert.equal((await pendingOf(r)).length, 0);
        assert.equal(await r.redis.xlen(n.stream), 0);
        const [dead] = await listDeadLetters(r.redis, n);
        assert.equal(dead!.original_id, id);
        assert.equal(dead!.deliveries, 4);
        assert.equal(dead!.reason, "exceeded 3 deliveries");
        assert.deepEqual(dead!.fields, { job_id: "j-fail", tenant: "acme", payload: "{}" });
      } finally {
        await w.close();
      }
    });

    await t.step("a PermanentJobError is dead-lettered after one call", async () => {
      await reset();
      await add({ job_id: "j-perm", tenant: "acme" });
      let calls = 0;
      const w = worker(r, "c1", () => {
        calls++;
        return Promise.reject(new PermanentJobError("400 from model"));
      });
      try {
        await w.runOnce(0);
        await w.drain();
        assert.equal(calls, 1);
        const dead = await listDeadLetters(r.redis, n);
        assert.equal(dead.length, 1);
        assert.equal(dead[0]!.reason, "permanent: 400 from model");
        assert.equal(dead[0]!.deliveries, 1);
        assert.equal((await pendingOf(r)).length, 0);
      } finally {
        await w.close();
      }
    });

    await t.step("replay re-enqueues the original fields and removes the dead entry; twice is harmless", async () => {
      const [dead] = await listDeadLetters(r.redis, n);
      const before = await r.redis.xlen(n.stream);
      const newId = await replayDeadLetter(r.redis, n, dead!.id);
      assert.ok(newId);
      assert.equal(await replayDeadLetter(r.redis, n, dead!.id), null);
      assert.equal(await r.redis.xlen(n.stream), before + 1);
      assert.equal((await listDeadLetters(r.redis, n)).length, 0);
      const [entry] = await r.redis.xrange(n.stream, newId!, newId!);
      assert.deepEqual(entry![1], ["job_id", "j-perm", "tenant", "acme"]);
    });

    await t.step("idle consumers with nothing pending are pruned; one holding messages stays", async () => {
      await reset();
      await add();
      const busy = worker(r, "busy", () => new Promise(() => {}));
      await busy.runOnce(0); // holds one pending message
      await busy.close();
      await r.redis.xgroup("CREATECONSUMER", n.stream, n.group, "ghost");
      const w = worker(r, "self", () => Promise.resolve(), { pruneIdleMs: 50 });
      try {
        await w.runOnce(0);
        await new Promise((res) => setTimeout(res, 100));
        assert.deepEqual(await w.pruneConsumers(), ["ghost"]);
        const left = (await r.redis.call("XINFO", "CONSUMERS", n.stream, n.group) as unknown[][])
          .map((c) => String(c[1])).sort();
        assert.ok(left.includes("busy") && !left.includes("ghost"), `left: ${left}`);
        assert.equal((await pendingOf(r)).length, 1, "the busy consumer's message is still pending");
      } finally {
        await w.close();
      }
    });

    await t.step(
      "a read between the pruner's look and its delete: the consumer stays, its message is not lost",
      async () => {
        await reset();
        await r.redis.xgroup("CREATECONSUMER", n.stream, n.group, "sleeper");
        const id = await add();
        const w = createStreamWorker(
          {
            redis: r.redis,
            log: silentLogger,
            faults: {
              // The pruner has seen "sleeper" idle with nothing pending; now it wakes and reads.
              async beforePrune(consumer) {
                if (consumer !== "sleeper") return;
                await r.redis.xreadgroup("GROUP", n.group, "sleeper", "COUNT", 1, "STREAMS", n.stream, ">");
              },
            },
          },
          {
            lanes: staticLanes([n]),
            consumer: "self",
            claimIdleMs: 60_000,
            maxDeliveries: 5,
            concurrency: 1,
            pruneIdleMs: 50,
          },
          () => Promise.resolve(),
        );
        try {
          await new Promise((res) => setTimeout(res, 100));
          assert.deepEqual(await w.pruneConsumers(), [], "nothing pruned");
          const pending = await pendingOf(r);
          assert.deepEqual(
            pending.map(([pid, owner]) => [pid, owner]),
            [[id, "sleeper"]],
            "still pending, for reclaim",
          );
        } finally {
          await w.close();
        }
      },
    );

    await t.step("graceful stop: in-flight handlers finish; those past the grace period stay pending", async () => {
      await reset();
      await add({ job_id: "quick", tenant: "acme" });
      await add({ job_id: "stuck", tenant: "acme" });
      const finished: string[] = [];
      const w = worker(r, "c1", async (m, signal) => {
        if (m.fields.job_id === "quick") await new Promise((res) => setTimeout(res, 100));
        else await new Promise((_, reject) => signal.addEventListener("abort", () => reject(signal.reason)));
        finished.push(m.fields.job_id!);
      }, { graceMs: 300 });
      const stop = new AbortController();
      const running = w.run(stop.signal);
      try {
        await waitFor("both in flight", () => w.inFlight === 2);
        const started = performance.now();
        stop.abort();
        await running;
        assert.ok(performance.now() - started < 2_000);
        assert.deepEqual(finished, ["quick"]);
        const pending = await pendingOf(r);
        assert.equal(pending.length, 1, "the abandoned one stays pending for reclaim");
      } finally {
        await w.close();
      }
    });

    await t.step(
      "a finishing handler gives its slot to the next message; as many more are read ahead; the caps hold",
      async () => {
        await reset();
        for (let i = 0; i < 8; i++) await add({ job_id: `j${i}`, tenant: "acme" });
        const started: string[] = [];
        const commits = new Map<string, () => void>();
        let before = 0, peakBefore = 0, peakAll = 0;
        const w = worker(r, "c1", async (m, _signal, finishing) => {
          started.push(m.fields.job_id!);
          before++;
          peakBefore = Math.max(peakBefore, before);
          peakAll = Math.max(peakAll, w.inFlight);
          // The model's part is over at once; the commit waits until the test lets it go.
          await new Promise((res) => setTimeout(res, 1));
          before--;
          finishing();
          await new Promise<void>((res) => commits.set(m.fields.job_id!, res));
        }, { concurrency: 2 });
        try {
          assert.equal(await w.runOnce(), 2);
          await waitFor("j0 and j1 committing", () => commits.size === 2);
          // Both slots are free while j0 and j1 commit: two start at once, two more wait read ahead.
          assert.equal(await w.runOnce(), 4);
          await waitFor("j2 and j3 committing", () => commits.size === 4);
          assert.deepEqual(started, ["j0", "j1", "j2", "j3"]);
          assert.equal(w.inFlight, 4, "two finishing without a slot, two keeping theirs: the cap of finishing ones");
          assert.equal(await w.runOnce(), 0, "no slot, and as many read ahead as handlers finish without one");
          assert.equal((await pendingOf(r)).length, 6, "the messages read ahead are delivered to this consumer");
          commits.get("j0")!();
          // j2 finishes without its slot in j0's place; j4 takes j2's slot at once, without a read.
          await waitFor("j4 started", () => started.includes("j4"));
          assert.deepEqual(started, ["j0", "j1", "j2", "j3", "j4"]);
          for (let i = 0; i < 20 && started.length < 8; i++) {
            for (const [id, go] of commits) if (started.includes(id)) go();
            await w.runOnce();
            await new Promise((res) => setTimeout(res, 5));
          }
          for (let i = 0; i < 20 && commits.size < 8; i++) await new Promise((res) => setTimeout(res, 5));
          for (const go of commits.values()) go();
          await w.drain();
          assert.deepEqual(started, ["j0", "j1", "j2", "j3", "j4", "j5", "j6", "j7"]);
          assert.equal(peakBefore, 2, "never more than `concurrency` before finishing");
          assert.ok(peakAll <= 4, `never more than twice \`concurrency\` in all (${peakAll})`);
          await waitFor("all acked", async () => (await pendingOf(r)).length === 0);
        } finally {
          await w.close();
        }
      },
    );

    await t.step("a stop hands back messages read ahead at once: never started, no delivery spent", async () => {
      await reset();
      for (const id of ["stuck1", "stuck2", "next"]) await add({ job_id: id, tenant: "acme" });
      const started: string[] = [];
      const handedBack: string[] = [];
      const w = worker(r, "c1", async (m, signal, finishing) => {
        started.push(m.fields.job_id!);
        finishing();
        await new Promise((_, reject) => signal.addEventListener("abort", () => reject(signal.reason)));
      }, {
        concurrency: 1,
        graceMs: 200,
        onHandedBack: (_lane: unknown, m: StreamMessage) => Promise.resolve(void handedBack.push(m.fields.job_id!)),
      });
      const stop = new AbortController();
      const running = w.run(stop.signal);
      try {
        // stuck1 finishes without its slot, stuck2 takes it (and keeps it: one is finishing already), next waits.
        await waitFor("all three delivered", async () => (await pendingOf(r)).length === 3);
        assert.deepEqual(started, ["stuck1", "stuck2"]);
        stop.abort();
        await running;
        assert.deepEqual(started, ["stuck1", "stuck2"], "the one read ahead never starts");
        assert.deepEqual(handedBack, ["next"]);
        assert.equal((await pendingOf(r)).length, 2, "the two abandoned past the grace stay pending for reclaim");
        // `next` is a new entry at the end of the stream, delivered to no one, with no delivery counted.
        const entries = await r.redis.xrange(n.stream, "-", "+");
        const last = entries[entries.length - 1]!;
        const fields = Object.fromEntries(
          last[1].reduce<string[][]>(
            (pairs, v, i) => (i % 2 ? pairs[pairs.length - 1]!.push(v) : pairs.push([v]), pairs),
            [],
          ),
        );
        assert.equal(fields.job_id, "next");
        assert.equal(fields.prior_deliveries, undefined);
        assert.ok(!(await pendingOf(r)).some(([id]) => id === last[0]));
        assert.equal(w.inFlight, 0);
      } finally {
        await w.close();
      }
    });

    await t.step("a stop within the grace: a slot that frees does not start the message read ahead", async () => {
      await reset();
      for (const id of ["a", "b", "c"]) await add({ job_id: id, tenant: "acme" });
      const started: string[] = [];
      const release = gate();
      const w = worker(r, "c1", async (m, _signal, finishing) => {
        started.push(m.fields.job_id!);
        finishing();
        await release.opened;
      }, { concurrency: 1, graceMs: 5_000 });
      const stop = new AbortController();
      const running = w.run(stop.signal);
      try {
        // a finishes without its slot, b takes it (and keeps it), c is read ahead.
        await waitFor("all three delivered", async () => (await pendingOf(r)).length === 3);
        assert.deepEqual(started, ["a", "b"]);
        stop.abort();
        // The running handlers finish well within the grace, after the stop: b's slot frees.
        setTimeout(release.open, 50);
        await running;
        assert.deepEqual(started, ["a", "b"]);
        assert.equal((await pendingOf(r)).length, 0, "a and b acknowledged, c handed back");
        assert.equal(await r.redis.xlen(n.stream), 1, "c waits in the stream for any worker");
      } finally {
        await w.close();
      }
    });
    await t.step(
      "a stop while Redis does not answer still returns: the hand-back is bounded by the grace",
      async () => {
        await reset();
        for (const id of ["a", "b", "c"]) await add({ job_id: id, tenant: "acme" });
        let hang = false;
        // ioredis with maxRetriesPerRequest: null while Redis is unreachable: its scripts wait for ever.
        const redis = new Proxy(r.redis, {
          get(target, name, receiver) {
            const value = Reflect.get(target, name, receiver);
            if (typeof value !== "function") return value;
            return (...args: unknown[]) =>
              hang && (name === "evalsha" || name === "eval") ? new Promise(() => {}) : value.apply(target, args);
          },
        });
        const w = createStreamWorker({ redis, log: silentLogger }, {
          lanes: staticLanes([names(r.prefix)]),
          reclaimIntervalMs: 0,
          consumer: "c1",
          claimIdleMs: 60_000,
          maxDeliveries: 5,
          concurrency: 1,
          blockMs: 10,
          graceMs: 200,
        }, async (_m, signal, finishing) => {
          finishing();
          await new Promise((_, reject) => signal.addEventListener("abort", () => reject(signal.reason)));
        });
        const stop = new AbortController();
        const running = w.run(stop.signal);
        try {
          await waitFor("all three delivered", async () => (await pendingOf(r)).length === 3);
          hang = true;
          stop.abort();
          // Before, the hand-back's requeue waited for Redis for ever, ahead of the grace period.
          assert.ok(await settlesWithin(running, 10_000), "run() returned after the stop");
          hang = false;
          assert.equal((await pendingOf(r)).length, 3, "nothing handed back: all stay pending for a reclaim");
        } finally {
          hang = false;
          await w.close();
        }
      },
    );

    await t.step("a message read ahead that another worker reclaimed is left to it at the stop", async () => {
      await reset();
      for (const id of ["a", "b", "c"]) await add({ job_id: id, tenant: "acme" });
      const w = worker(r, "c1", async (_m, signal, finishing) => {
        finishing();
        await new Promise((_, reject) => signal.addEventListener("abort", () => reject(signal.reason)));
      }, { concurrency: 1, graceMs: 200 });
      const stop = new AbortController();
      const running = w.run(stop.signal);
      try {
        await waitFor("all three delivered", async () => (await pendingOf(r)).length === 3);
        const c = (await pendingOf(r))[2]![0];
        // c1 stalled past claimIdleMs (its heartbeat failing): another worker reclaimed the message it read ahead.
        await r.redis.xclaim(n.stream, n.group, "c2", 0, c);
        stop.abort();
        await running;
        const after = await pendingOf(r);
        assert.ok(after.some(([id, owner]) => id === c && owner === "c2"), "c2's delivery is untouched");
        const copies = (await r.redis.xrange(n.stream, "-", "+")).filter(([, fields]) => fields[1] === "c");
        assert.deepEqual(copies.map(([id]) => id), [c], "no second copy of the job");
      } finally {
        await w.close();
      }
    });
  } finally {
    await r.close();
  }
});
