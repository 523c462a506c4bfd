/**
 * Batch leases (issue 43): a process holds a batch for a step only as long as it lives. The lease is short and
 * renewed while the step runs, so a step slower than the lease keeps the batch, and a process killed mid-step
 * leaves it to the next one a lease later, not ten minutes later. A lease is a token: a process that stalled past
 * its lease neither renews nor frees a batch another process has taken since.
 */
import assert from "node:assert/strict";
import { sleep } from "../../src/async/timeout.ts";
import { leaseBatch, releaseBatch, renewLease, whileLeased } from "../../src/batches/batch_store.ts";
import { batchWorld } from "./_fixture.ts";

const STATES = ["open"] as const;

Deno.test("a step slower than the lease keeps its batch: renewed while it runs, given back when it ends", async () => {
  const world = await batchWorld();
  try {
    await world.recordRuns(1);
    const batch = (await leaseBatch(world.sql, STATES, { leaseMs: 300 }))!;
    assert.ok(batch.lease, "the lease is its token");
    let takenMeanwhile = 0, lost = 0;
    await whileLeased(world.sql, batch, 300, async () => {
      // Three leases long: another process looks every 50 ms and never gets it.
      for (const until = performance.now() + 900; performance.now() < until;) {
        if (await leaseBatch(world.sql, STATES, { leaseMs: 300 })) takenMeanwhile++;
        await sleep(50);
      }
    }, () => lost++);
    assert.equal(takenMeanwhile, 0, "nobody took the batch while its step ran");
    assert.equal(lost, 0);
    const [row] = await world.sql<{ lease_until: Date | null }[]>`SELECT lease_until FROM batches`;
    assert.equal(row!.lease_until, null, "given back at the end of the step");
  } finally {
    await world.close();
  }
});

Deno.test("a killed holder's batch is taken again one lease later", async () => {
  const world = await batchWorld();
  try {
    await world.recordRuns(1);
    // The first process takes it and dies: nothing renews its lease.
    assert.ok(await leaseBatch(world.sql, STATES, { leaseMs: 300 }));
    assert.equal(await leaseBatch(world.sql, STATES, { leaseMs: 300 }), undefined, "held for its lease");
    await sleep(350);
    assert.ok(await leaseBatch(world.sql, STATES, { leaseMs: 300 }), "taken again after it");
  } finally {
    await world.close();
  }
});

Deno.test("a holder that stalled past its lease neither renews nor frees the batch another took since", async () => {
  const world = await batchWorld();
  try {
    await world.recordRuns(1);
    const stalled = (await leaseBatch(world.sql, STATES, { leaseMs: 100 }))!;
    await sleep(150);
    const next = (await leaseBatch(world.sql, STATES, { leaseMs: 60_000 }))!;
    assert.ok(next, "the next process takes it once the lease ran out");
    assert.equal(await renewLease(world.sql, stalled, 60_000), undefined, "the stalled one's renewal finds it lost");
    await releaseBatch(world.sql, stalled);
    assert.equal(await leaseBatch(world.sql, STATES, { leaseMs: 100 }), undefined, "its release freed nothing");
    const renewed = await renewLease(world.sql, next, 60_000);
    assert.ok(renewed && renewed.lease !== next.lease, "the holder renews, with a new token");
  } finally {
    await world.close();
  }
});

Deno.test("a step whose renewals fail is stopped before its lease can lapse, and confirms nothing after", async () => {
  const world = await batchWorld();
  try {
    await world.recordRuns(1);
    const batch = (await leaseBatch(world.sql, STATES, { leaseMs: 300 }))!;
    // Renewals that never answer, as with Postgres out of reach: a query that waits on a lock held meanwhile.
    const blocker = await world.sql.reserve();
    await blocker`BEGIN`;
    await blocker`SELECT 1 FROM batches WHERE id = ${batch.id}::uuid FOR UPDATE`;
    let lost = 0;
    const started = performance.now();
    const stoppedAfter = await whileLeased(world.sql, batch, 300, async ({ signal }) => {
      // A provider call that honours the step's signal.
      await new Promise<void>((resolve) => signal.addEventListener("abort", () => resolve(), { once: true }));
      return performance.now() - started;
    }, () => lost++);
    await blocker`ROLLBACK`;
    blocker.release();
    assert.equal(lost, 1, "told once");
    // The first renewal (at 100 ms) hangs; the tick at 200 ms sees the lease could lapse by 300 ms and stops the step.
    assert.ok(stoppedAfter < 300, `stopped before the lease could lapse (${stoppedAfter.toFixed(0)} ms)`);
  } finally {
    await world.close();
  }
});

Deno.test("confirm() before an effect fails once another process has taken the batch", async () => {
  const world = await batchWorld();
  try {
    await world.recordRuns(1);
    // A lease too short for the renewal timer (under 30 ms): the holder stalls past it, as one whose event loop
    // was blocked would, and another process takes the batch meanwhile.
    const stalled = (await leaseBatch(world.sql, STATES, { leaseMs: 20 }))!;
    let created = 0;
    const outcome = await whileLeased(world.sql, stalled, 20, async ({ confirm }) => {
      await sleep(60);
      assert.ok(await leaseBatch(world.sql, STATES, { leaseMs: 60_000 }));
      await confirm(); // throws: the create below never goes out
      created++;
    }).then(() => "went on", (error) => (error as Error).name);
    assert.equal(outcome, "LeaseLost");
    assert.equal(created, 0);
  } finally {
    await world.close();
  }
});
