/**
 * The queue's Redis writes applied twice, as ioredis's resend of an unanswered command applies them (issue 35): the
 * same command, with the same arguments, run again after Redis already ran it. Each must leave the lane as one run
 * does, and answer the caller what the first run did.
 */
import assert from "node:assert/strict";
import { silentLogger } from "../../src/log/logger.ts";
import { createAckBatcher } from "../../src/queue/ack_batcher.ts";
import { createGroupCache, ensureGroup } from "../../src/queue/consumer_group.ts";
import { createConsumerPruner } from "../../src/queue/consumer_pruner.ts";
import { deleteEmptyStream } from "../../src/queue/delete_empty_stream_script.ts";
import { createHeartbeat } from "../../src/queue/heartbeat.ts";
import { createLaneReader } from "../../src/queue/lane_reader.ts";
import { announceLane, createLaneShares, laneRegistryKeys } from "../../src/queue/lanes.ts";
import type { LaneNames, QueueNames, StreamMessage } from "../../src/queue/message.ts";
import { createReclaimer } from "../../src/queue/reclaimer.ts";
import { requeue } from "../../src/queue/requeue.ts";
import { staticLanes } from "../../src/queue/static_lanes.ts";
import { createTestRedis, type TestRedis } from "../_support.ts";
import { recordingRedis, resendingRedis, sendAgain } from "../support/resending_redis.ts";

type Pending = [id: string, consumer: string, idleMs: number, deliveries: number];

Deno.test("the queue's writes applied twice change the lane once", async (t) => {
  const r = await createTestRedis();
  const twice = resendingRedis(r.redis);
  let run = 0;
  /** A fresh lane with `n` messages and its group. */
  const laneWith = async (n: number): Promise<{ lane: QueueNames & LaneNames; ids: string[] }> => {
    const tag = `${r.prefix}:{t:twice${run++}}`;
    const lane = { stream: `${tag}:stream`, streams: [`${tag}:stream`], dead: `${tag}:dead`, group: "g" };
    await ensureGroup(r.redis, lane);
    const ids: string[] = [];
    for (let i = 0; i < n; i++) {
      ids.push(await r.redis.xadd(lane.stream, "*", "job_id", `j${i}`, "tenant", "t") as string);
    }
    return { lane, ids };
  };
  const pendingOf = async ({ stream, group }: QueueNames) =>
    await r.redis.xpending(stream, group, "-", "+", 100) as Pending[];
  const readerOf = (redis: TestRedis["redis"], lane: LaneNames, consumer: string, laneMaxInFlight = 0) =>
    createLaneReader({ redis }, {
      consumer,
      lanes: staticLanes([lane]),
      groups: createGroupCache({ redis: r.redis, log: silentLogger }),
      shares: createLaneShares(),
      laneMaxInFlight,
    });
  /** Reads up to `free` messages with `reader`, without waiting. @returns the ids started. */
  const read = async (reader: ReturnType<typeof readerOf>, free: number) => {
    const started: StreamMessage[] = [];
    await reader.read(free, 0, (_lane, _stream, m) => started.push(m));
    return started;
  };

  try {
    await t.step("a take resent hands the consumer the messages its first run delivered", async () => {
      const { lane, ids } = await laneWith(4);
      const started = await read(readerOf(twice, lane, "c1"), 2);
      // Run again without its record, the take reads the next two: the first two stay pending to c1, unseen,
      // until a reclaim after the claim idle time (one more delivery).
      assert.deepEqual(started.map((m) => [m.id, m.deliveries]), [[ids[0], 1], [ids[1], 1]]);
      assert.deepEqual((await pendingOf(lane)).map(([id, c, , n]) => [id, c, n]), [[ids[0], "c1", 1], [
        ids[1],
        "c1",
        1,
      ]]);
      // The next take is a new one: it reads on.
      const next = await read(readerOf(r.redis, lane, "c1"), 2);
      assert.deepEqual(next.map((m) => m.id), ids.slice(2));
    });

    await t.step(
      "a take resent over a lane of two streams hands the consumer what it delivered from each",
      async () => {
        const { lane: first, ids: firstIds } = await laneWith(1);
        const tag = first.stream.slice(0, first.stream.lastIndexOf(":"));
        const second = { stream: `${tag}:second`, dead: first.dead, group: first.group };
        await ensureGroup(r.redis, second);
        const secondIds: string[] = [];
        for (let i = 0; i < 3; i++) secondIds.push(await r.redis.xadd(second.stream, "*", "job_id", `s${i}`) as string);
        const lane = { streams: [first.stream, second.stream], dead: first.dead, group: first.group };
        const started = await read(readerOf(twice, lane, "c1"), 3);
        assert.deepEqual(started.map((m) => m.id), [firstIds[0], secondIds[0], secondIds[1]]);
        assert.deepEqual((await pendingOf(first)).map(([id, c, , n]) => [id, c, n]), [[firstIds[0], "c1", 1]]);
        assert.deepEqual((await pendingOf(second)).map(([id, c, , n]) => [id, c, n]), [
          [secondIds[0], "c1", 1],
          [secondIds[1], "c1", 1],
        ]);
      },
    );

    await t.step("a capped take resent is answered its messages, not the cap they reached", async () => {
      const { lane, ids } = await laneWith(3);
      const started = await read(readerOf(twice, lane, "c1", 2), 3);
      assert.deepEqual(started.map((m) => m.id), ids.slice(0, 2));
      assert.equal((await pendingOf(lane)).length, 2);
    });

    await t.step("a take resent leaves out what another consumer reclaimed meanwhile", async () => {
      const { lane, ids } = await laneWith(2);
      const recording = recordingRedis(r.redis);
      await read(readerOf(recording.redis, lane, "c1"), 2);
      // The reply was lost for longer than the claim idle time: c2 reclaimed the first message before the resend.
      await r.redis.xclaim(lane.stream, lane.group, "c2", 0, ids[0]!);
      const [capped, entries] = await sendAgain(r.redis, recording.sent.at(-1)!) as [number, [string, string[]][]];
      assert.deepEqual([capped, entries.map(([id]) => id)], [0, [ids[1]]]);
      assert.deepEqual((await pendingOf(lane)).map(([id, c]) => [id, c]), [[ids[0], "c2"], [ids[1], "c1"]]);
    });

    await t.step("a reclaim resent hands the consumer the messages its first run claimed", async () => {
      const { lane, ids } = await laneWith(4);
      await r.redis.xreadgroup("GROUP", lane.group, "c1", "COUNT", 4, "STREAMS", lane.stream, ">");
      await new Promise((resolve) => setTimeout(resolve, 30));
      const reclaimer = createReclaimer({ redis: twice }, {
        consumer: "c2",
        claimIdleMs: 20,
        intervalMs: 0,
        lanes: staticLanes([lane]),
        groups: createGroupCache({ redis: r.redis, log: silentLogger }),
        holds: () => false,
        held: () => 0,
      });
      const started: StreamMessage[] = [];
      await reclaimer.reclaim(2, (_lane, _stream, m) => started.push(m));
      // Run again without its record, XAUTOCLAIM passes over the two it just claimed (idle no more) and claims the
      // next two: the first two stay pending to c2, unseen, and spend one more delivery at the next reclaim.
      assert.deepEqual(started.map((m) => [m.id, m.deliveries]), [[ids[0], 2], [ids[1], 2]]);
      assert.deepEqual((await pendingOf(lane)).map(([id, c, , n]) => [id, c, n]), [
        [ids[0], "c2", 2],
        [ids[1], "c2", 2],
        [ids[2], "c1", 1],
        [ids[3], "c1", 1],
      ]);
    });

    await t.step("a requeue resent adds one entry and answers its id", async () => {
      const { lane, ids } = await laneWith(1);
      const [message] = await read(readerOf(r.redis, lane, "c1"), 1);
      const again = await requeue(twice, lane, message!, "c1");
      // Run again without its record, the requeue finds the entry gone and answers null: the worker then neither
      // wakes the lane's readers nor counts the deferral.
      assert.notEqual(again, null);
      const entries = await r.redis.xrange(lane.stream, "-", "+");
      assert.deepEqual(entries.map(([id]) => id), [again]);
      assert.notEqual(again, ids[0]);
      assert.deepEqual(await pendingOf(lane), []);
      // Another consumer asking to requeue the same entry is told it does not hold it.
      assert.equal(await requeue(r.redis, lane, message!, "c9"), null);
    });

    await t.step("an empty stream's delete resent answers that the stream is gone", async () => {
      const { lane } = await laneWith(0);
      assert.equal(await deleteEmptyStream(twice, lane.stream), true);
      assert.equal(await r.redis.exists(lane.stream), 0);
      const { lane: full } = await laneWith(1);
      assert.equal(await deleteEmptyStream(twice, full.stream), false);
      assert.equal(await r.redis.xlen(full.stream), 1);
    });

    await t.step("a heartbeat resent refreshes the same messages and spends no delivery", async () => {
      const { lane, ids } = await laneWith(2);
      await r.redis.xreadgroup("GROUP", lane.group, "c1", "COUNT", 1, "STREAMS", lane.stream, ">");
      await r.redis.xreadgroup("GROUP", lane.group, "c2", "COUNT", 1, "STREAMS", lane.stream, ">");
      const held = ids.map((id) => ({ stream: lane, id }));
      const heartbeat = createHeartbeat({ redis: twice, log: silentLogger }, {
        consumer: "c1",
        intervalMs: 1_000,
        held: () => held,
      });
      assert.deepEqual(await heartbeat.beat(), [ids[0]]);
      assert.deepEqual((await pendingOf(lane)).map(([id, c, , n]) => [id, c, n]), [[ids[0], "c1", 1], [
        ids[1],
        "c2",
        1,
      ]]);
    });

    await t.step("an idle consumer's removal resent removes nothing more", async () => {
      const { lane } = await laneWith(1);
      await r.redis.xgroup("CREATECONSUMER", lane.stream, lane.group, "gone");
      await r.redis.xreadgroup("GROUP", lane.group, "busy", "COUNT", 1, "STREAMS", lane.stream, ">");
      await new Promise((resolve) => setTimeout(resolve, 20));
      const pruner = createConsumerPruner({ redis: twice, log: silentLogger }, {
        consumer: "me",
        lanes: staticLanes([lane]),
        groups: createGroupCache({ redis: r.redis, log: silentLogger }),
        idleMs: 10,
      });
      await pruner.prune();
      const consumers = await r.redis.call("XINFO", "CONSUMERS", lane.stream, lane.group) as unknown[][];
      assert.deepEqual(consumers.map((c) => c[1]), ["busy"]);
      assert.equal((await pendingOf(lane)).length, 1);
    });

    await t.step("an ack resent acknowledges and deletes nothing more, and does not fail", async () => {
      const { lane, ids } = await laneWith(2);
      await r.redis.xreadgroup("GROUP", lane.group, "c1", "COUNT", 2, "STREAMS", lane.stream, ">");
      const ack = createAckBatcher(r.redis);
      // The ack script (XACK + XDEL), sent again as it was.
      await ack({ stream: lane, id: ids[0]! });
      await ack({ stream: lane, id: ids[0]! });
      assert.deepEqual((await pendingOf(lane)).map(([id]) => id), [ids[1]]);
      assert.deepEqual((await r.redis.xrange(lane.stream, "-", "+")).map(([id]) => id), [ids[1]]);
    });

    await t.step("a group's creation resent finds it there and goes on", async () => {
      const { lane } = await laneWith(1);
      await ensureGroup(r.redis, lane);
      await ensureGroup(r.redis, lane);
      assert.equal(await r.redis.xlen(lane.stream), 1);
    });

    await t.step("a lane's announce resent leaves the registry as one does (and wakes the workers again)", async () => {
      const keys = laneRegistryKeys(`${r.prefix}:twice`);
      await announceLane(twice, keys, "acme");
      assert.deepEqual(await r.redis.smembers(keys.active), ["acme"]);
      assert.deepEqual(await r.redis.smembers(keys.all), ["acme"]);
    });
  } finally {
    await r.close();
  }
});
