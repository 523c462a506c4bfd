/**
 * Intake queues a run on its priority's stream of the tenant's lane, in the same script as ever, and the queue
 * caps count the lane over all its priorities. Real Redis; back to back on one lane.
 */
import assert from "node:assert/strict";
import { QueueFull } from "../../src/runs/intake.ts";
import { createIntake } from "../../src/runs/intake.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import type { Scope } from "../../src/idempotency/scope.ts";
import { createTestRedis } from "../_support.ts";

const PATH = "/v1/tasks/triage/runs";

Deno.test("intake: a run's priority picks its lane's stream; the caps count every priority", async (t) => {
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  let n = 0;
  const scopeOf = (tenant: string): Scope => ({ tenant, method: "POST", path: PATH, key: `k-${++n}` });
  const run = (priority?: "high" | "low" | "batch") => ({
    task: "triage",
    version: 1,
    payload: JSON.stringify({ task: "triage", version: 1, input: { n }, ...(priority ? { priority } : {}) }),
    ...(priority ? { priority: priority === "batch" ? "low" as const : priority, requested: priority } : {}),
  });
  try {
    await t.step("high, normal and low runs go to the lane's high, intake and low streams", async () => {
      const intake = createIntake({ redis: r.redis }, { keys, resultTtlS: 600, path: PATH });
      const lane = keys.lane("acme");
      for (const priority of ["high", undefined, "low"] as const) {
        await intake.submitRun({ scope: scopeOf("acme"), request: { input: { n }, priority }, run: run(priority) });
      }
      assert.deepEqual(
        await Promise.all([lane.streamOf("high"), lane.stream, lane.streamOf("low")].map((s) => r.redis.xlen(s))),
        [1, 1, 1],
      );
      // A replay of the high run answers it again and queues nothing.
      const scope = scopeOf("acme");
      const first = await intake.submitRun({ scope, request: { input: 1, priority: "high" }, run: run("high") });
      const again = await intake.submitRun({ scope, request: { input: 1, priority: "high" }, run: run("high") });
      assert.equal(again.replayed, true);
      assert.equal(again.jobId, first.jobId);
      assert.equal(await r.redis.xlen(lane.streamOf("high")), 2);
      // The status record names a priority other than normal, as asked (a batch run waits on the low stream).
      assert.equal(await r.redis.hget(lane.job(first.jobId), "priority"), "high");
      const batch = await intake.submitRun({ scope: scopeOf("acme"), request: { input: 2 }, run: run("batch") });
      assert.equal(await r.redis.hget(lane.job(batch.jobId), "priority"), "batch");
      assert.equal(await r.redis.xlen(lane.streamOf("low")), 2);
    });

    await t.step("INTAKE_MAX_QUEUED_PER_TENANT counts the lane's runs of every priority", async () => {
      const intake = createIntake({ redis: r.redis }, { keys, resultTtlS: 600, path: PATH, maxQueuedPerTenant: 4 });
      const lane = keys.lane("beta");
      await intake.submitRun({ scope: scopeOf("beta"), request: { input: n }, run: run("high") });
      await intake.submitRun({ scope: scopeOf("beta"), request: { input: n }, run: run("low") });
      await intake.submitRun({ scope: scopeOf("beta"), request: { input: n }, run: run() });
      await intake.submitRun({ scope: scopeOf("beta"), request: { input: n }, run: run("low") });
      for (const priority of ["high", undefined, "low"] as const) {
        await assert.rejects(
          intake.submitRun({ scope: scopeOf("beta"), request: { input: n, priority }, run: run(priority) }),
          QueueFull,
          `a ${priority ?? "normal"} run beyond the lane's 4`,
        );
      }
      const lengths = await Promise.all(lane.streams.map((s) => r.redis.xlen(s)));
      assert.equal(lengths.reduce((a, b) => a + b, 0), 4);
      // Another tenant's lane is its own.
      await intake.submitRun({ scope: scopeOf("gamma"), request: { input: n }, run: run("high") });
    });
  } finally {
    await r.close();
  }
});
