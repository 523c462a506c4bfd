/**
 * The queue's per-lane scripts as issue 39 left them: the take makes a missing group and says when it drained its
 * lane, the ack is one script, and the look at a drained lane is one command.
 */
import assert from "node:assert/strict";
import { TAKE_WITHIN_CAP_SCRIPT } from "../../src/queue/take_within_cap_script.ts";
import { ACK_SCRIPT } from "../../src/queue/ack_script.ts";
import { HAS_UNDELIVERED_SCRIPT } from "../../src/queue/has_undelivered_script.ts";
import { ensureGroup } from "../../src/queue/consumer_group.ts";
import { createTestRedis } from "../_support.ts";

type Entry = [id: string, fields: string[]];

Deno.test("the take, the ack and the look at a drained lane", async (t) => {
  const r = await createTestRedis();
  let run = 0;
  const laneOf = (streams = 1) => {
    const tag = `${r.prefix}:{take${run++}}`;
    return { tag, streams: Array.from({ length: streams }, (_, i) => `${tag}:s${i}`), group: "g" };
  };
  const take = async (lane: { tag: string; streams: string[]; group: string }, count: number, cap = 0) => {
    const [state, ...perStream] = await TAKE_WITHIN_CAP_SCRIPT.run(
      r.redis,
      [`${lane.tag}:taken:c`, ...lane.streams],
      [lane.group, "c", count, cap, crypto.randomUUID(), 60_000],
    ) as [number, ...Entry[][]];
    return { state, ids: perStream.map((entries) => entries.map(([, f]) => f[1])) };
  };
  /** A take with the lane's priority state (its last key) and shares: a resend passes the same `id`. */
  const takeShared = async (
    lane: { tag: string; streams: string[]; group: string },
    count: number,
    shares: number[],
    { id = crypto.randomUUID(), cap = 0 } = {},
  ) => {
    const [state, ...perStream] = await TAKE_WITHIN_CAP_SCRIPT.run(
      r.redis,
      [`${lane.tag}:taken:c`, ...lane.streams, `${lane.tag}:priority`],
      [lane.group, "c", count, cap, id, 60_000, lane.streams.length, ...shares],
    ) as [number, ...Entry[][]];
    return { state, ids: perStream.map((entries) => entries.map(([, f]) => f[1])) };
  };
  const add = async (stream: string, ...jobs: string[]) => {
    for (const job of jobs) await r.redis.xadd(stream, "*", "job_id", job);
  };

  try {
    await t.step("a stream without its group gets it at the first take, read from its first entry", async () => {
      const lane = laneOf();
      await add(lane.streams[0]!, "a", "b", "c");
      assert.deepEqual(await take(lane, 2), { state: 0, ids: [["a", "b"]] });
      assert.deepEqual(await take(lane, 5), { state: 2, ids: [["c"]] }, "fewer than asked: drained");
    });

    await t.step("a take of exactly what is left says it drained the lane", async () => {
      const lane = laneOf();
      await add(lane.streams[0]!, "a", "b");
      assert.deepEqual(await take(lane, 2), { state: 2, ids: [["a", "b"]] });
      await add(lane.streams[0]!, "c");
      assert.deepEqual(await take(lane, 1), { state: 2, ids: [["c"]] });
    });

    await t.step("a lane with no stream at all: nothing taken, drained, and no stream made", async () => {
      const lane = laneOf();
      assert.deepEqual(await take(lane, 3, 10), { state: 2, ids: [[]] });
      assert.equal(await r.redis.exists(lane.streams[0]!), 0);
    });

    await t.step("a lane of two streams is drained only when the second is empty too", async () => {
      const lane = laneOf(2);
      await add(lane.streams[0]!, "a1", "a2");
      await add(lane.streams[1]!, "b1");
      assert.deepEqual(await take(lane, 2), { state: 0, ids: [["a1", "a2"], []] }, "the second stream not read");
      assert.deepEqual(await take(lane, 2), { state: 2, ids: [[], ["b1"]] });
    });

    await t.step(
      "shared takes: 4 : 1 while both streams hold messages, a resend answers the same and moves no pass",
      async () => {
        const lane = laneOf(2);
        await add(lane.streams[0]!, ...Array.from({ length: 12 }, (_, i) => `n${i}`));
        await add(lane.streams[1]!, ...Array.from({ length: 12 }, (_, i) => `l${i}`));
        // Both start a stride after the lane's time: n at 1/4, l at 1; n goes until its pass passes l's.
        const id = crypto.randomUUID();
        const first = await takeShared(lane, 5, [4, 1], { id });
        assert.deepEqual(first, { state: 0, ids: [["n0", "n1", "n2", "n3"], ["l0"]] });
        const passes = await r.redis.hgetall(`${lane.tag}:priority`);
        assert.deepEqual(await takeShared(lane, 5, [4, 1], { id }), first, "the resend: the same messages");
        assert.deepEqual(await r.redis.hgetall(`${lane.tag}:priority`), passes, "and no pass moved");
        assert.deepEqual(await takeShared(lane, 5, [4, 1]), { state: 0, ids: [["n4", "n5", "n6", "n7"], ["l1"]] });
        // The cap counts both streams' pending messages: 10 pending, cap 12: two more.
        assert.deepEqual(await takeShared(lane, 5, [4, 1], { cap: 12 }), { state: 0, ids: [["n8", "n9"], []] });
        assert.deepEqual((await takeShared(lane, 5, [4, 1], { cap: 12 })).state, 1, "capped");
        // The rest: the normal stream runs out, the low one gives the rest, and the lane is drained.
        const rest = await takeShared(lane, 20, [4, 1]);
        assert.deepEqual(rest, {
          state: 2,
          ids: [["n10", "n11"], ["l2", "l3", "l4", "l5", "l6", "l7", "l8", "l9", "l10", "l11"]],
        });
      },
    );

    await t.step("the cap counts a group the take had to make as holding nothing", async () => {
      const lane = laneOf();
      await add(lane.streams[0]!, "a", "b", "c");
      assert.deepEqual(await take(lane, 5, 2), { state: 0, ids: [["a", "b"]] });
      assert.deepEqual(await take(lane, 5, 2), { state: 1, ids: [[]] }, "capped");
    });

    await t.step("the ack acknowledges and deletes its entries and starts its records' lifetimes", async () => {
      const lane = laneOf();
      const stream = lane.streams[0]!;
      await add(stream, "a", "b", "c");
      await ensureGroup(r.redis, { stream, dead: `${lane.tag}:dead`, group: "g" });
      const taken = await r.redis.xreadgroup("GROUP", "g", "c", "COUNT", 3, "STREAMS", stream, ">") as [
        string,
        Entry[],
      ][];
      const ids = taken[0]![1].map(([id]) => id);
      const record = `${lane.tag}:job:a`;
      await r.redis.set(record, "x");
      assert.equal(await ACK_SCRIPT.run(r.redis, [stream, record], ["g", 2, ids[0]!, ids[1]!, 30]), 2);
      assert.deepEqual((await r.redis.xrange(stream, "-", "+")).map(([id]) => id), [ids[2]]);
      assert.equal(Number((await r.redis.xpending(stream, "g") as [number])[0]), 1);
      const ttl = await r.redis.ttl(record);
      assert.ok(ttl > 0 && ttl <= 30, `the record's lifetime: ${ttl}`);
    });

    await t.step("the look at a drained lane: undelivered entries in any stream, or none", async () => {
      const lane = laneOf(2);
      const look = () => HAS_UNDELIVERED_SCRIPT.run(r.redis, lane.streams, ["g"]);
      assert.equal(await look(), 0, "no streams");
      await add(lane.streams[1]!, "b1");
      assert.equal(await look(), 1, "a stream without the group holds only undelivered entries");
      await take(lane, 1);
      assert.equal(await look(), 0, "every entry delivered (pending)");
      await add(lane.streams[0]!, "a1");
      assert.equal(await look(), 1);
    });
  } finally {
    await r.close();
  }
});
