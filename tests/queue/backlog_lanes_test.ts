/**
 * The backlog walk's reads (`measureBacklog`, `src/queue/backlog.ts`) over lanes of different shapes in one walk:
 * on one server 64 lanes a script call, so the lanes of a call are sliced by their stream counts; on a Redis Cluster
 * (`ONCELY_TEST_CLUSTER=1`) one lane a call. Either way each lane's figures are its own: every count and the
 * deepest lanes match what was put in each lane.
 */
import assert from "node:assert/strict";
import { measureBacklog } from "../../src/queue/backlog.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createTestRedis } from "../_support.ts";

Deno.test("the backlog walk reads lanes of 3 and of 1 stream in one walk, each lane's figures its own", async () => {
  const r = await createTestRedis();
  try {
    const wide = serviceKeys(`${r.prefix}:wide`);
    const narrow = serviceKeys(`${r.prefix}:narrow`, { laneStreams: ["stream"] });
    const lane = (id: string) => id.startsWith("n") ? narrow.lane(id) : wide.lane(id);
    const now = Date.now();
    const depths = new Map<string, number>();
    let oldest = Infinity;
    // 150 lanes of three streams (normal, and every fifth a high one too) and 30 of one, interleaved in the set, so
    // that a call of 64 lanes holds both shapes; each lane a different depth, the first entry's time its own.
    const ids = Array.from({ length: 180 }, (_, i) => (i % 6 === 5 ? `n${i}` : `w${i}`));
    for (const [i, id] of ids.entries()) {
      const names = lane(id);
      const normal = 1 + (i % 7);
      for (let j = 0; j < normal; j++) {
        const at = now - 1_000_000 + i * 1_000 + j;
        oldest = Math.min(oldest, at);
        await r.redis.xadd(names.streamOf("normal"), `${at}-0`, "job_id", `${id}-${j}`, "tenant", id);
      }
      const high = id.startsWith("w") && i % 5 === 0 ? 2 : 0;
      for (let j = 0; j < high; j++) await r.redis.xadd(names.streamOf("high"), "*", "job_id", `${id}-h${j}`);
      depths.set(id, normal + high);
    }
    // One lane's first entry delivered to its group: in flight, so not waiting (its depth unchanged).
    const taken = lane("w0");
    await r.redis.xgroup("CREATE", taken.streams[0]!, taken.group, "0");
    await r.redis.xreadgroup("GROUP", taken.group, "c", "COUNT", 1, "STREAMS", taken.streams[0]!, ">");
    await r.redis.sadd(wide.registry.active, ...ids);

    const snapshot = await measureBacklog(r.redis, {
      active: wide.registry.active,
      keys: wide.backlog,
      lane,
      lanesPerSecond: 1e9,
      deepest: 180,
    });
    const total = [...depths.values()].reduce((n, d) => n + d, 0);
    assert.equal(snapshot.lanes, 180);
    assert.equal(snapshot.depth, total);
    assert.equal(snapshot.waiting, total - 1, "all but the delivered one");
    // w0's one entry (the oldest of all) is in flight: the oldest waiting is w1's first, a second later.
    assert.equal(snapshot.oldestAcceptedMs, oldest + 1_000);
    assert.deepEqual(
      new Map(snapshot.deepest),
      depths,
      "every lane named with its own depth (all 180 kept)",
    );
  } finally {
    await r.close();
  }
});
