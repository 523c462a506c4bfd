/**
 * Priority within a tenant's lane: its high, normal and low streams share the lane's takes 16 : 4 : 1 while
 * several hold runs (stride scheduling in the take script), so high runs overtake the tenant's own backlog, no
 * priority is starved, and the lane's share of the worker between tenants does not change. The real summary
 * worker, real Redis and Postgres; the model a local one that records the order it was asked in.
 */
import assert from "node:assert/strict";
import { createExtractiveLlm } from "../../src/llm/extractive.ts";
import { announceLane } from "../../src/queue/lanes.ts";
import { type Priority, serviceKeys } from "../../src/runs/keys.ts";
import { enqueueRunToLane } from "../support/enqueue.ts";
import { summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

Deno.test("priorities within a lane: high overtakes the tenant's backlog, low is never starved, tenants keep their shares", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const extractive = createExtractiveLlm();
  /** The runs' names in the order their model calls finished. */
  const finished: string[] = [];
  const llm: typeof extractive = {
    async complete(prompt, options) {
      const answer = await extractive.complete(prompt, options);
      // A call takes a little while, so runs taken together are in flight together.
      await new Promise((resolve) => setTimeout(resolve, 2));
      finished.push(/\[(\S+)\]/.exec(prompt)?.[1] ?? "?");
      return answer;
    },
  };
  const queue = async (tenant: string, name: string, priority?: Priority) =>
    await enqueueRunToLane(r.redis, keys, {
      jobId: crypto.randomUUID(),
      tenant,
      run: { task: "summarize", version: 1, input: { text: `Revenue rose [${name}]. Costs fell.` } },
    }, { announce: false, priority });
  const drain = async (total: number, concurrency: number) => {
    const worker = summaryWorker({ redis: r.redis, sql: db.sql, llm, keys }, { concurrency });
    const stop = new AbortController();
    const running = worker.run(stop.signal);
    try {
      await waitFor(`${total} runs`, () => finished.length >= total, 60_000);
    } finally {
      stop.abort();
      await running;
      await worker.close();
    }
  };

  try {
    await t.step(
      "100 high runs posted behind 500 low ones of the tenant all finish before its 150th low one",
      async () => {
        finished.length = 0;
        for (let i = 0; i < 500; i++) await queue("acme", `acme-low-${i}`, "low");
        for (let i = 0; i < 100; i++) await queue("acme", `acme-high-${i}`, "high");
        // Another tenant's normal runs, queued throughout.
        for (let i = 0; i < 150; i++) await queue("beta", `beta-${i}`);
        await announceLane(r.redis, keys.registry, "acme");
        await announceLane(r.redis, keys.registry, "beta");
        await drain(750, 8);
        const lows = finished.filter((n) => n.startsWith("acme-low"));
        const lastHigh = finished.lastIndexOf(finished.filter((n) => n.startsWith("acme-high")).at(-1)!);
        const lowsBefore = finished.slice(0, lastHigh).filter((n) => n.startsWith("acme-low")).length;
        assert.equal(lows.length, 500);
        assert.ok(lowsBefore < 150, `${lowsBefore} low runs finished before the last high one`);
        // The other tenant kept its share: half of the first 300 runs were beta's (two lanes of equal weight).
        const betaEarly = finished.slice(0, 300).filter((n) => n.startsWith("beta")).length;
        assert.ok(betaEarly >= 130 && betaEarly <= 170, `${betaEarly} of the first 300 runs were beta's`);
      },
    );

    await t.step(
      "a low run behind 300 queued high runs starts within the bound: 1 in 17 of the lane's takes",
      async () => {
        finished.length = 0;
        for (let i = 0; i < 300; i++) await queue("gamma", `gamma-high-${i}`, "high");
        await queue("gamma", "gamma-low", "low");
        await announceLane(r.redis, keys.registry, "gamma");
        await drain(301, 1);
        // With one slot, each take is one run: the low stream's pass starts one of its strides (1) after the lane's,
        // and each high run moves the high stream's by 1/16, so the low run goes after 16 high ones at most.
        const at = finished.indexOf("gamma-low");
        // `at` counts from 0: the 17th run of the lane is at 16.
        assert.ok(at >= 0 && at <= 16, `the low run was the ${at + 1}th run of its lane`);
      },
    );

    await t.step("normal overtakes low, and the three share 16 : 4 : 1 while all have runs", async () => {
      finished.length = 0;
      for (let i = 0; i < 210; i++) await queue("delta", `delta-low-${i}`, "low");
      for (let i = 0; i < 210; i++) await queue("delta", `delta-normal-${i}`);
      for (let i = 0; i < 210; i++) await queue("delta", `delta-high-${i}`, "high");
      await announceLane(r.redis, keys.registry, "delta");
      await drain(630, 1);
      const first = finished.slice(0, 210);
      const count = (p: string) => first.filter((n) => n.startsWith(`delta-${p}`)).length;
      // 210 takes at 16 : 4 : 1 are 160, 40 and 10 (give or take one each at the start).
      assert.ok(Math.abs(count("high") - 160) <= 2, `high ${count("high")}`);
      assert.ok(Math.abs(count("normal") - 40) <= 2, `normal ${count("normal")}`);
      assert.ok(Math.abs(count("low") - 10) <= 2, `low ${count("low")}`);
      // Once high is done, normal and low share 4 : 1.
      const afterHigh = finished.slice(finished.lastIndexOf(finished.filter((n) => n.includes("high")).at(-1)!) + 1);
      const next = afterHigh.slice(0, 100);
      const lowNext = next.filter((n) => n.includes("low")).length;
      assert.ok(lowNext >= 17 && lowNext <= 23, `${lowNext} of 100 were low once only normal and low were left`);
    });
  } finally {
    await r.close();
    await db.close();
  }
});
