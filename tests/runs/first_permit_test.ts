/**
 * The first permit a run asks for before its pre-check goes back when the call ends before its first attempt
 * (here: a delivery budget too short for one attempt, so the retry policy stops before it asks its gate).
 * Without that, the permit's tokens and a probe's lease stayed held until they expired.
 */
import assert from "node:assert/strict";
import type { LLM } from "../../src/llm/llm.ts";
import type { CallOutcome, Models } from "../../src/llm/models.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { enqueueToLane } from "../support/enqueue.ts";
import { summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

Deno.test("a first permit the call never took is settled as not sent", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  let calls = 0;
  const llm: LLM = {
    complete() {
      calls++;
      return Promise.reject(new Error("not expected: no attempt fits the budget"));
    },
  };
  const settled: CallOutcome[] = [];
  let acquired = 0;
  const models: Models = {
    defaultModel: "m",
    acquire() {
      acquired++;
      return Promise.resolve({
        llm,
        model: "m",
        deployment: "m",
        permit: {
          waitedMs: 0,
          settle(outcome) {
            settled.push(outcome);
            return Promise.resolve(false);
          },
        },
      });
    },
  };
  // 50 ms of budget for a delivery, against the policy's least useful attempt (the call timeout, 1 s here).
  const worker = summaryWorker({ redis: r.redis, sql: db.sql, models, keys }, {
    job: { budgetMs: 50, perCallTimeoutMs: 1_000, maxAttempts: 3 },
  });
  try {
    await enqueueToLane(r.redis, keys, {
      jobId: crypto.randomUUID(),
      tenant: "acme",
      request: { text: "Revenue rose.", notify: "ops@example.com" },
    });
    await worker.runOnce(0);
    await worker.drain();
    await waitFor("the first permit settled", () => settled.length > 0);
    assert.equal(acquired, 1, "one permit asked for");
    assert.equal(calls, 0, "no attempt was made");
    assert.equal(settled.length, 1, "settled once");
    assert.equal(settled[0]!.aborted, true);
  } finally {
    await worker.close();
    await r.close();
    await db.close();
  }
});
