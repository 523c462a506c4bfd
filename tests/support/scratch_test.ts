/**
 * Redis database indexes for tests, benches and chaos runs: Redis outlives
 * every run, and a run can be killed before it cleans up, so an index is
 * claimed, and a claim whose process is gone (or leftovers of the service's
 * keys) never makes the indexes run out. Another's keys are never touched.
 */
import assert from "node:assert/strict";
import { Redis } from "ioredis";
import { REDIS_URL } from "../_support.ts";
import { emptyRedisDatabase, releaseRedisDatabase } from "./scratch.ts";

/** A Redis Cluster has one database: the claims are for the standalone server. */
const ignore = Deno.env.get("ONCELY_TEST_CLUSTER") === "1";

const CLAIM = "oncely_test:redis_db_claim:";

function indexOf(url: string): number {
  return Number(new URL(url).pathname.slice(1));
}

Deno.test({
  name: "emptyRedisDatabase() claims an index per caller and releaseRedisDatabase() flushes it and gives it back",
  ignore,
  fn: async () => {
    const a = await emptyRedisDatabase(REDIS_URL);
    const b = await emptyRedisDatabase(REDIS_URL);
    const db = new Redis(a, { maxRetriesPerRequest: 1 });
    const admin = new Redis(REDIS_URL, { maxRetriesPerRequest: 1 });
    try {
      assert.notEqual(indexOf(a), indexOf(b), "two live claims never share an index");
      await db.set("oncely:left", "1");
      await releaseRedisDatabase(a);
      assert.equal(await db.dbsize(), 0, "released: flushed");
      assert.equal(await admin.get(`${CLAIM}${indexOf(a)}`), null, "and no longer claimed");
      await releaseRedisDatabase(a); // twice: nothing
    } finally {
      db.disconnect();
      admin.disconnect();
      await releaseRedisDatabase(b);
    }
  },
});

Deno.test({
  name: "emptyRedisDatabase() takes over the index of a process that died holding it, whatever it left",
  ignore,
  fn: async () => {
    const a = await emptyRedisDatabase(REDIS_URL);
    const db = new Redis(a, { maxRetriesPerRequest: 1 });
    const admin = new Redis(REDIS_URL, { maxRetriesPerRequest: 1 });
    try {
      await db.mset("oncely:stream", "x", "left_by_a_test", "y");
      // The claimant was SIGKILLed: its pid is gone (a pid above the kernel's maximum never runs).
      const dead = `${Deno.hostname()}|4294967295|${Date.now()}|dead`;
      await admin.set(`${CLAIM}${indexOf(a)}`, dead);
      const again = await emptyRedisDatabase(REDIS_URL);
      assert.equal(indexOf(again), indexOf(a), "the dead claim's index is free again (the highest free one)");
      assert.equal(await db.dbsize(), 0, "its leftovers flushed, a key of no known prefix included");
      assert.notEqual(await admin.get(`${CLAIM}${indexOf(a)}`), dead);
      await releaseRedisDatabase(again);
    } finally {
      db.disconnect();
      admin.disconnect();
    }
  },
});

Deno.test({
  name: "emptyRedisDatabase() flushes an unclaimed index of service keys and never touches one holding others' keys",
  ignore,
  fn: async () => {
    const a = await emptyRedisDatabase(REDIS_URL);
    const db = new Redis(a, { maxRetriesPerRequest: 1 });
    const admin = new Redis(REDIS_URL, { maxRetriesPerRequest: 1 });
    try {
      // Left by a run of an earlier release, which claimed nothing: only the service's keys.
      await releaseRedisDatabase(a);
      await db.set("oncely:{t:acme}:stream", "x");
      const b = await emptyRedisDatabase(REDIS_URL);
      assert.equal(indexOf(b), indexOf(a));
      assert.equal(await db.dbsize(), 0, "the service's leftovers flushed");
      await releaseRedisDatabase(b);

      // Someone's own data in the index: skipped, kept.
      await db.set("someone:else", "keep me");
      const c = await emptyRedisDatabase(REDIS_URL);
      try {
        assert.notEqual(indexOf(c), indexOf(a));
        assert.equal(await db.get("someone:else"), "keep me");
        assert.equal(await admin.get(`${CLAIM}${indexOf(a)}`), null, "and not left claimed");
      } finally {
        await releaseRedisDatabase(c);
      }
    } finally {
      await db.del("someone:else");
      db.disconnect();
      admin.disconnect();
    }
  },
});
