/**
 * Lanes at scale (issue 39): what a read, a reclaim pass and the fair shares cost does not grow with the number
 * of lanes. The assertions count Redis commands and lanes asked, never elapsed time.
 */
import assert from "node:assert/strict";
import { announceLane, createLaneRegistry, createLaneShares, laneRegistryKeys } from "../../src/queue/lanes.ts";
import type { LaneNames, QueueNames } from "../../src/queue/message.ts";
import { createStreamWorker } from "../../src/queue/stream_worker.ts";
import { ensureGroup } from "../../src/queue/consumer_group.ts";
import { silentLogger } from "../../src/log/logger.ts";
import type { RedisClient } from "../../src/clients.ts";
import { createTestRedis } from "../_support.ts";
import { TAKE_WITHIN_CAP_SCRIPT } from "../../src/queue/take_within_cap_script.ts";
import { ACK_SCRIPT } from "../../src/queue/ack_script.ts";
import { HAS_UNDELIVERED_SCRIPT } from "../../src/queue/has_undelivered_script.ts";

const scriptNames = new Map([
  [TAKE_WITHIN_CAP_SCRIPT.sha, "take"],
  [ACK_SCRIPT.sha, "ack"],
  [HAS_UNDELIVERED_SCRIPT.sha, "hasUndelivered"],
]);

/** `redis`, counting every command method called on it (the queue's scripts by name), by name. */
function countingRedis(redis: RedisClient): { redis: RedisClient; calls: Map<string, number>; reset(): void } {
  const calls = new Map<string, number>();
  const proxy = new Proxy(redis, {
    get(target, property, receiver) {
      const value = Reflect.get(target, property, receiver);
      if (typeof value !== "function" || typeof property !== "string" || property === "duplicate") return value;
      return (...args: unknown[]) => {
        // A script by its name where known (its sha otherwise), a command by its method.
        const name = property === "evalsha" ? scriptNames.get(String(args[0])) ?? "evalsha" : property;
        calls.set(name, (calls.get(name) ?? 0) + 1);
        return value.apply(target, args);
      };
    },
  });
  return { redis: proxy, calls, reset: () => calls.clear() };
}

Deno.test("lane shares over 20,000 lanes: every lane asked once before any twice, each plan bounded", () => {
  const shares = createLaneShares();
  const lanes = Array.from({ length: 20_000 }, (_, i) => `lane-${String(i).padStart(5, "0")}`);
  for (const id of lanes) shares.activate(id, 1);
  const asked = new Map<string, number>();
  for (let round = 0; round < Math.ceil(20_000 / 256); round++) {
    const plan = shares.plan(256);
    assert.ok(plan.length <= 256);
    for (const { lane, count } of plan) {
      assert.equal(count, 1, "a fair part of 256 slots over 20,000 lanes is one message");
      asked.set(lane, (asked.get(lane) ?? 0) + 1);
      shares.charge(lane, 1);
      shares.putBack(lane);
    }
  }
  assert.equal(asked.size, 20_000, "every lane was asked");
  assert.ok([...asked.values()].every((n) => n <= 2), "no lane asked a third time before every lane was asked");
  assert.equal(
    [...asked.values()].filter((n) => n === 2).length,
    Math.ceil(20_000 / 256) * 256 - 20_000,
    "the second time round starts with the lanes asked first",
  );
});

Deno.test("lane shares forget drained lanes a few at a time, and a drained lane is never planned", () => {
  const shares = createLaneShares();
  for (let i = 0; i < 1_000; i++) shares.activate(`l${i}`, 1);
  for (let i = 0; i < 1_000; i++) shares.drained(`l${i}`);
  shares.activate("kept", 1);
  assert.deepEqual(shares.plan(10).map((p) => p.lane), ["kept"]);
  shares.putBack("kept");
  for (let i = 0; i < 200 && shares.size().known > 1; i++) shares.plan(1).forEach((p) => shares.putBack(p.lane));
  assert.deepEqual(shares.size(), { active: 1, known: 1 });
});

Deno.test("lanes at scale", async (t) => {
  const r = await createTestRedis();
  let run = 0;
  const setup = (tenants: number) => {
    const prefix = `${r.prefix}:scale${run++}`;
    const keys = laneRegistryKeys(prefix);
    const lane = (id: string): QueueNames & LaneNames => ({
      stream: `${prefix}:{t:${id}}:stream`,
      streams: [`${prefix}:{t:${id}}:stream`],
      dead: `${prefix}:{t:${id}}:dead`,
      group: "g",
    });
    const ids = Array.from({ length: tenants }, (_, i) => `t${i}`);
    const fill = async (perLane: number) => {
      // Sent at once a batch at a time, not as a pipeline: on a cluster the lanes are in many slots.
      for (let i = 0; i < ids.length; i += 500) {
        await Promise.all(
          ids.slice(i, i + 500).flatMap((id) =>
            Array.from({ length: perLane }, (_, k) => r.redis.xadd(lane(id).stream, "*", "job_id", `${id}-${k}`))
          ),
        );
      }
      // Announced at once, as the drain bench does: both sets, one wake-up.
      await r.redis.multi().sadd(keys.active, ...ids).sadd(keys.all, ...ids).publish(keys.wake, ids[0]!).exec();
    };
    return { prefix, keys, lane, ids, fill };
  };

  /** A worker of 8 slots on the registry of `keys`, recording the jobs it starts. */
  const workerOn = (redis: RedisClient, keys: ReturnType<typeof laneRegistryKeys>, lane: (id: string) => LaneNames) => {
    const registry = createLaneRegistry({ redis, log: silentLogger }, { keys, lane });
    const started: string[] = [];
    const worker = createStreamWorker({ redis, log: silentLogger }, {
      consumer: "w",
      claimIdleMs: 60_000,
      maxDeliveries: 5,
      concurrency: 8,
      blockMs: 0,
      lanes: registry,
    }, (m) => {
      started.push(String(m.fields.job_id));
      return Promise.resolve();
    });
    return { registry, worker, started };
  };

  try {
    await t.step("a read over 3,000 lanes with work sends about one take per message it starts", async () => {
      const { keys, lane, fill } = setup(3_000);
      await fill(1);
      const counted = countingRedis(r.redis);
      const { registry, worker, started } = workerOn(counted.redis, keys, lane);
      try {
        await worker.runOnce(0); // the first walk and the first batch of lanes
        await worker.drain();
        counted.reset();
        let reads = 0;
        while (started.length < 3_000 && reads < 2_000) {
          await worker.runOnce(0);
          await worker.drain();
          reads++;
        }
        assert.equal(started.length, 3_000);
        assert.equal(new Set(started).size, 3_000, "each job started once");
        // Each read: the batch of news (one SSCAN, and one more while a reclaim pass walks every lane), the takes
        // (one per lane asked, one message each), and for a lane its take drained, the idle (SREM, then XLEN and
        // XPENDING). Never a call per lane known.
        const per = (name: string) => (counted.calls.get(name) ?? 0) / reads;
        assert.equal(counted.calls.get("smembers") ?? 0, 0, "no read asks for every lane");
        assert.ok(per("sscan") <= 2, `SSCAN per read: ${per("sscan")}`);
        const calls = (name: string) => counted.calls.get(name) ?? 0;
        // A take per job: the take that drains a lane says so, so no second take finds it empty.
        assert.ok(calls("take") <= 3_000 * 1.05, `${calls("take")} takes for 3,000 jobs`);
        // A drained lane's idle: one SREM per read for all of them, and a look at each lane after it.
        assert.ok(calls("hasUndelivered") <= 3_000 * 1.05, `${calls("hasUndelivered")} looks for 3,000 lanes`);
        assert.ok(per("srem") <= 1, `SREM per read: ${per("srem")}`);
        assert.ok(calls("ack") <= 3_000, `${calls("ack")} acks for 3,000 jobs`);
        assert.equal(calls("xgroup"), 0, "the take makes a lane's group, no command before it");
      } finally {
        await registry.close();
      }
    });

    await t.step(
      "a pass of the reclaimer over 2,000 lanes goes a batch per read and reclaims what a crash left",
      async () => {
        const { keys, lane, ids } = setup(2_000);
        for (const id of ids) await ensureGroup(r.redis, lane(id));
        // A consumer that died holding one message in each of three lanes, far apart.
        const stranded = [ids[7]!, ids[1_000]!, ids[1_999]!];
        for (const id of stranded) {
          await r.redis.xadd(lane(id).stream, "*", "job_id", `${id}-lost`, "tenant", id);
          await r.redis.xreadgroup("GROUP", "g", "dead-worker", "COUNT", 1, "STREAMS", lane(id).stream, ">");
        }
        await r.redis.sadd(keys.all, ...ids);
        const counted = countingRedis(r.redis);
        const registry = createLaneRegistry({ redis: counted.redis, log: silentLogger }, { keys, lane });
        const reclaimed: string[] = [];
        const worker = createStreamWorker({ redis: counted.redis, log: silentLogger }, {
          consumer: "rescuer",
          claimIdleMs: 1,
          reclaimIntervalMs: 60_000,
          maxDeliveries: 5,
          concurrency: 8,
          blockMs: 0,
          lanes: registry,
          events: { delivered: (m, source) => source === "reclaimed" && reclaimed.push(String(m.fields.job_id)) },
        }, () => Promise.resolve());
        try {
          await new Promise((resolve) => setTimeout(resolve, 5));
          let reads = 0;
          let mostXpending = 0;
          while (reclaimed.length < 3 && reads < 100) {
            counted.reset();
            await worker.runOnce(0);
            await worker.drain();
            mostXpending = Math.max(mostXpending, counted.calls.get("call") ?? 0);
            reads++;
          }
          assert.deepEqual(reclaimed.sort(), stranded.map((id) => `${id}-lost`).sort());
          assert.ok(reads >= 2, "the pass took more than one read");
          assert.ok(mostXpending <= 1_024, `at most a batch of lanes probed per read: ${mostXpending}`);
        } finally {
          await registry.close();
        }
      },
    );

    await t.step("a lane that gets work while another worker drained it is found again", async () => {
      const { keys, lane, fill } = setup(3);
      await fill(1);
      const { registry, worker, started } = workerOn(r.redis, keys, lane);
      try {
        for (let i = 0; i < 5 && started.length < 3; i++) {
          await worker.runOnce(0);
          await worker.drain();
        }
        assert.equal(started.length, 3);
        // New work in a lane the reader dropped as drained: its announce names it.
        await r.redis.xadd(lane("t1").stream, "*", "job_id", "t1-late", "tenant", "t1");
        await announceLane(r.redis, keys, "t1");
        for (let i = 0; i < 50 && started.length < 4; i++) {
          await worker.runOnce(0);
          await worker.drain();
          await registry.wait(20);
        }
        assert.deepEqual(started.slice(3), ["t1-late"]);
      } finally {
        await registry.close();
      }
    });
  } finally {
    await r.close();
  }
});

Deno.test("a lane refilled within a few plans of draining keeps its place; later it starts at the clock", () => {
  const shares = createLaneShares();
  shares.activate("a", 1);
  shares.activate("b", 1);
  // A runs three messages and they finish: the clock moves to A's finished service, 3.
  const plan = shares.plan(4);
  assert.deepEqual(plan.map((p) => p.lane), ["a", "b"]);
  const charges = [shares.charge("a", 1), shares.charge("a", 1), shares.charge("a", 1)];
  for (const c of charges) shares.settle(c, 1);
  // B took one message and its take drained it; its next job arrives at once: B keeps its virtual time, 1.
  shares.charge("b", 1);
  shares.drained("b");
  shares.activate("b", 1);
  assert.equal(shares.finish("b"), 1);
  // Drained again, and back only after more plans than the grace: it starts at the clock, banking nothing.
  shares.drained("b");
  for (let i = 0; i <= 4; i++) shares.plan(1).forEach((p) => shares.putBack(p.lane));
  shares.activate("b", 1);
  assert.equal(shares.finish("b"), 3);
});
