/**
 * Redis database indexes for tests, benches and chaos runs: Redis outlives
 * every run, and a run can be killed before it cleans up, so an index is
 * claimed with an expiring key its process renews, and a lapsed claim (or
 * leftovers of the service's keys) never makes the indexes run out. Another's
 * keys are never touched.
 */
import assert from "node:assert/strict";
import { Redis } from "ioredis";
import { REDIS_URL } from "../_support.ts";
import { CLAIM_TTL_MS, emptyRedisDatabase, releaseRedisDatabase } from "./scratch.ts";

/** A Redis Cluster has one database: the claims are for the standalone server. */
const ignore = Deno.env.get("ONCELY_TEST_CLUSTER") === "1";

const CLAIM = "scratch_redis_db:claim:";
const USED = "scratch_redis_db:used:";

function indexOf(url: string): number {
  return Number(new URL(url).pathname.slice(1));
}

/** A claimed database, a client on it and one on database 0 (where the claims are); `close` gives them back. */
async function claimed() {
  const url = await emptyRedisDatabase(REDIS_URL);
  const db = new Redis(url, { maxRetriesPerRequest: 1 });
  const admin = new Redis(REDIS_URL, { maxRetriesPerRequest: 1 });
  return {
    url,
    index: indexOf(url),
    db,
    admin,
    close() {
      db.disconnect();
      admin.disconnect();
      return releaseRedisDatabase(url);
    },
  };
}

Deno.test({
  name:
    "emptyRedisDatabase() claims an index per caller, renewably, and releaseRedisDatabase() flushes it and frees it",
  ignore,
  fn: async () => {
    const a = await claimed();
    const b = await emptyRedisDatabase(REDIS_URL);
    try {
      assert.notEqual(a.index, indexOf(b), "two live claims never share an index");
      const ttl = await a.admin.pttl(`${CLAIM}${a.index}`);
      assert.ok(ttl > 0 && ttl <= CLAIM_TTL_MS, `the claim expires unless renewed (${ttl} ms)`);
      await a.db.set("oncely:left", "1");
      await releaseRedisDatabase(a.url);
      assert.equal(await a.db.dbsize(), 0, "released: flushed");
      assert.equal(await a.admin.exists(`${CLAIM}${a.index}`), 0, "and no longer claimed");
      await releaseRedisDatabase(a.url); // twice: nothing
    } finally {
      await a.close();
      await releaseRedisDatabase(b);
    }
  },
});

Deno.test({
  name: "emptyRedisDatabase() takes over an index whose claim lapsed (its process killed), whatever it left",
  ignore,
  fn: async () => {
    const a = await claimed();
    try {
      await a.db.mset("oncely:stream", "x", "left_by_a_test", "y");
      // The claimant was SIGKILLed: nothing renews its claim, which lapses.
      await a.admin.pexpire(`${CLAIM}${a.index}`, 1);
      await new Promise((r) => setTimeout(r, 20));
      const again = await emptyRedisDatabase(REDIS_URL);
      assert.equal(indexOf(again), a.index, "the lapsed claim's index is free again (the highest free one)");
      assert.equal(await a.db.dbsize(), 0, "its leftovers flushed, a key of no known prefix included");
      await releaseRedisDatabase(again);
    } finally {
      await a.close();
    }
  },
});

Deno.test({
  name: "emptyRedisDatabase() flushes a never-claimed index of service keys and never touches one of others' keys",
  ignore,
  fn: async () => {
    const a = await claimed();
    try {
      // Left by a run of an earlier release, which claimed nothing: only the service's keys.
      await releaseRedisDatabase(a.url);
      await a.admin.del(`${USED}${a.index}`);
      await a.db.set("oncely:{t:acme}:stream", "x");
      const b = await emptyRedisDatabase(REDIS_URL);
      assert.equal(indexOf(b), a.index);
      assert.equal(await a.db.dbsize(), 0, "the service's leftovers flushed");
      await releaseRedisDatabase(b);

      // Someone's own data in an index no test has used: skipped, kept.
      await a.admin.del(`${USED}${a.index}`);
      await a.db.set("someone:else", "keep me");
      const c = await emptyRedisDatabase(REDIS_URL);
      try {
        assert.notEqual(indexOf(c), a.index);
        assert.equal(await a.db.get("someone:else"), "keep me");
        assert.equal(await a.admin.exists(`${CLAIM}${a.index}`), 0, "and not left claimed");
      } finally {
        await releaseRedisDatabase(c);
      }
    } finally {
      await a.db.del("someone:else");
      await a.close();
    }
  },
});
