/**
 * The lane reader's walk for news of lanes with work, against its takes: a reader woken from idle takes the
 * woken lane's first message beside the walk (one round trip before the first job, not two), and the lanes the
 * walk names still share the other free slots of that read. The lane source is a stand-in whose walks the test
 * answers by hand, so the order of events is decided by the test, never by timing.
 */
import assert from "node:assert/strict";
import { createGroupCache } from "../../src/queue/consumer_group.ts";
import { createLaneReader } from "../../src/queue/lane_reader.ts";
import { createLaneShares, type LaneSource } from "../../src/queue/lanes.ts";
import type { LaneNames } from "../../src/queue/message.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { createTestRedis, waitFor } from "../_support.ts";

Deno.test("lane reader", async (t) => {
  const r = await createTestRedis();
  let run = 0;
  const setup = async (backlogs: Record<string, number>) => {
    const prefix = `${r.prefix}:run${run++}`;
    const lane = (id: string): LaneNames => ({
      streams: [`${prefix}:{t:${id}}:stream`],
      dead: `${prefix}:{t:${id}}:dead`,
      group: "g",
    });
    for (const [id, n] of Object.entries(backlogs)) {
      for (let i = 0; i < n; i++) await r.redis.xadd(lane(id).streams[0]!, "*", "job_id", `${id}-${i}`);
    }
    // What happened, in order: each walk asked and answered, each message started.
    const events: string[] = [];
    const walks: PromiseWithResolvers<LaneNames[]>[] = [];
    let news: ((lane: LaneNames) => void) | undefined;
    const source: LaneSource = {
      active() {
        events.push("walk");
        const walk = Promise.withResolvers<LaneNames[]>();
        walks.push(walk);
        return walk.promise.finally(() => events.push("walked"));
      },
      walk: () => ({ next: () => Promise.resolve({ lanes: [], done: true }) }),
      idle: () => Promise.resolve([]),
      wait: () => Promise.resolve(),
      onNews: (listener) => news = listener,
    };
    const reader = createLaneReader({ redis: r.redis }, {
      consumer: "w",
      lanes: source,
      groups: createGroupCache({ redis: r.redis, log: silentLogger }),
      shares: createLaneShares(),
    });
    const read = (free: number) =>
      reader.read(free, 0, (_lane, _stream, message) => events.push(message.fields.job_id!));
    /** The next walk the reader asks for, once it has asked. */
    const nextWalk = (n: number) => waitFor(`walk ${n}`, () => walks[n]);
    return { lane, events, read, nextWalk, wake: (id: string) => news!(lane(id)) };
  };

  try {
    await t.step("woken from idle, the woken lane's first message is taken beside the walk", async () => {
      const { lane, events, read, nextWalk, wake } = await setup({ a: 3, b: 3 });
      // A first read finds nothing: the reader is idle.
      const idle = read(4);
      (await nextWalk(0)).resolve([]);
      assert.equal(await idle, 0);
      wake("a");
      const reading = read(4);
      const walk = await nextWalk(1);
      await waitFor("a-0 started", () => events.includes("a-0"));
      assert.deepEqual(events, ["walk", "walked", "walk", "a-0"], "a-0 started before the walk was answered");
      // The walk names B too: B shares the three slots left, in the same read.
      walk.resolve([lane("a"), lane("b")]);
      assert.equal(await reading, 4);
      const after = events.slice(4);
      assert.ok(after.some((e) => e.startsWith("b-")), `B was served in that read: ${events.join(" ")}`);
      assert.ok(after.some((e) => e.startsWith("a-")), `A too: ${events.join(" ")}`);
    });

    await t.step("with one slot free, or after a read that started jobs, the walk comes before the take", async () => {
      const { events, read, nextWalk, wake } = await setup({ a: 3 });
      const idle = read(4);
      (await nextWalk(0)).resolve([]);
      assert.equal(await idle, 0);
      wake("a");
      // One slot: the lanes the walk names may be due before A, so it is answered first.
      const one = read(1);
      (await nextWalk(1)).resolve([]);
      assert.equal(await one, 1);
      assert.deepEqual(events.slice(-3), ["walk", "walked", "a-0"]);
      // The reader is busy now (its last read started a job): the walk comes first again, whatever is free.
      const busy = read(4);
      (await nextWalk(2)).resolve([]);
      assert.equal(await busy, 2);
      assert.deepEqual(events.slice(-4), ["walk", "walked", "a-1", "a-2"]);
    });

    await t.step(
      "a walk that fails beside a take: the message taken starts; a read that takes none throws",
      async () => {
        const { events, read, nextWalk, wake } = await setup({ a: 1 });
        const idle = read(4);
        (await nextWalk(0)).resolve([]);
        assert.equal(await idle, 0);
        wake("a");
        const reading = read(4);
        const walk = await nextWalk(1);
        await waitFor("a-0 started", () => events.includes("a-0"));
        walk.reject(new Error("walk failed"));
        assert.equal(await reading, 1, "the message taken is started, not left pending for a reclaim");
        // The next read walks again first (its last read started a job), and throws the walk's error as before.
        const next = read(4);
        (await nextWalk(2)).reject(new Error("walk failed again"));
        await assert.rejects(next, /walk failed again/);
      },
    );
  } finally {
    await r.close();
  }
});
