/**
 * The result cache's scripts applied twice, as ioredis's resend of an unanswered command applies them (issue 35):
 * the same call, with the same arguments, run again after Redis already ran it, with other runs' steps in between.
 * None needed a change: each is guarded by the lock's holder, which a second run checks again.
 */
import assert from "node:assert/strict";
import { CLAIM_SCRIPT } from "../../src/cache/claim_script.ts";
import { FILL_SCRIPT } from "../../src/cache/fill_script.ts";
import { LEASE_SCRIPT } from "../../src/cache/lease_script.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createTestRedis } from "../_support.ts";
import { recordingRedis, resendingRedis, sendAgain } from "../support/resending_redis.ts";

const LEASE_MS = 10_000;

Deno.test("the result cache's scripts applied twice leave the entry and its lock as one run does", async (t) => {
  const r = await createTestRedis();
  const twice = resendingRedis(r.redis);
  let n = 0;
  const entryOf = () => {
    const cache = serviceKeys(r.prefix).cache("acme");
    const hash = `h${n++}`;
    return { entry: cache.entry(hash), lock: cache.lock(hash) };
  };
  const claim = (redis: typeof r.redis, k: { entry: string; lock: string }, run: string) =>
    CLAIM_SCRIPT.run(redis, [k.entry, k.lock], [run, LEASE_MS]);
  try {
    await t.step("a claim resent holds the lock once, for the same run", async () => {
      const k = entryOf();
      assert.equal(await claim(twice, k, "run-a"), 1);
      assert.equal(await r.redis.get(k.lock), "run-a");
      assert.equal(await claim(r.redis, k, "run-b"), 0, "another run waits");
    });

    await t.step("a release resent never ends the lock a waiter took over meanwhile", async () => {
      const k = entryOf();
      await claim(r.redis, k, "run-a");
      const recording = recordingRedis(r.redis);
      assert.equal(await LEASE_SCRIPT.run(recording.redis, [k.lock], ["run-a", 0]), 1);
      assert.equal(await claim(r.redis, k, "run-b"), 1, "the waiter takes the free lock");
      assert.equal(await sendAgain(r.redis, recording.sent.at(-1)!), 0);
      assert.equal(await r.redis.get(k.lock), "run-b");
    });

    await t.step("a renewal resent extends the holder's own lease only", async () => {
      const k = entryOf();
      await claim(r.redis, k, "run-a");
      assert.equal(await LEASE_SCRIPT.run(twice, [k.lock], ["run-a", LEASE_MS]), 1);
      assert.equal(await LEASE_SCRIPT.run(twice, [k.lock], ["run-b", LEASE_MS]), 0);
      assert.equal(await r.redis.get(k.lock), "run-a");
    });

    await t.step("a fill resent stores the same entry and leaves a new lock alone", async () => {
      const k = entryOf();
      await claim(r.redis, k, "run-a");
      const value = JSON.stringify({
        source_run_id: "run-a",
        output: "x",
        model: "m",
        prompt_tokens: 1,
        completion_tokens: 1,
      });
      const recording = recordingRedis(r.redis);
      await FILL_SCRIPT.run(recording.redis, [k.entry, k.lock], [value, 60_000, "run-a"]);
      assert.equal(await r.redis.exists(k.lock), 0, "the fill ended the lock");
      // A run that finds the entry is a hit, and takes no lock: nothing can be between the fill and its resend.
      assert.equal(await claim(r.redis, k, "run-b"), value);
      assert.equal(await sendAgain(r.redis, recording.sent.at(-1)!), 1);
      assert.equal(await r.redis.get(k.entry), value);
      assert.equal(await r.redis.exists(k.lock), 0);
    });
  } finally {
    await r.close();
  }
});
