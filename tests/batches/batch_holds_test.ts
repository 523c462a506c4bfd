/**
 * Batch lines hold their worst case against the tenant's budgets from collection until the line settles (issue 43:
 * a tenant's spend never exceeds a budget, however many batches are in flight). The hold is charged at the line's
 * usage, or released when the line ends without an answer; it survives a budget hash lost in Redis (rebuilt from
 * `batch_runs`), and the sweep settles the holds no line settles. Real Redis and Postgres, the fake provider's
 * Batch API, the real run job, submitter and poller.
 */
import assert from "node:assert/strict";
import type { Sql } from "postgres";
import { createBatchPoller } from "../../src/batches/batch_poller.ts";
import { createBatchSubmitter } from "../../src/batches/batch_submitter.ts";
import { BudgetExhausted, type Budgets } from "../../src/budgets/budgets.ts";
import { seedBudgetState } from "../../src/budgets/seed_script.ts";
import { heldIn, runHold } from "../../src/budgets/hold_script.ts";
import { runSettleHold } from "../../src/budgets/settle_hold_script.ts";
import { tenantCommand } from "../../src/cli/tenant_command.ts";
import type { BatchIntake } from "../../src/runs/run_deps.ts";
import { createPrices } from "../../src/llm/prices.ts";
import type { Models } from "../../src/llm/models.ts";
import { createGroupCommitter } from "../../src/runs/commit.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createSummaryJob } from "../../src/runs/run_job.ts";
import { SUMMARIZE_TASK, type TaskCache } from "../../src/tasks/task_cache.ts";
import { setTenantBudget } from "../../src/tenants/tenant_budgets.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { budgetRecords, budgetsOn } from "../support/fixtures.ts";
import type { BatchScript } from "../support/fake_batch_api.ts";
import { createTestRedis } from "../_support.ts";
import { batchPayload, type BatchWorld, batchWorld, MODEL } from "./_fixture.ts";

const PRICE = { in: 2, out: 8, batch_in: 1, batch_out: 4 };
const prices = () => createPrices({ LLM_PRICES: { [MODEL]: PRICE } });
const USAGE = { prompt_tokens: 10, completion_tokens: 5 };

/** A world with budgets on one Redis, a run job that collects batch runs, and the count of online calls tried. */
async function holdsWorld(
  { maxRuns = 5000, script }: { maxRuns?: number; script?: (n: number) => BatchScript } = {},
) {
  const world = await batchWorld({
    maxRuns,
    script: script ?? (() => ({ line: () => ({ kind: "ok", usage: USAGE }) })),
  });
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  await createApiKey(world.sql, "acme");
  const budgets = budgetsOn({ redis: r.redis, sql: world.sql, keys }, { prices: prices(), ttlMs: 0 });
  let online = 0;
  const models: Models = { defaultModel: MODEL, acquire: () => Promise.reject(new Error(`online call ${++online}`)) };
  const tasks = { peek: () => SUMMARIZE_TASK, get: () => Promise.resolve(SUMMARIZE_TASK) } as unknown as TaskCache;
  const signal = new AbortController().signal;
  /** The run job over `intake`: delivers a batch run of `acme`; "batched", or the error (an online call's: it went online). */
  const jobWith = (intake: BatchIntake) => {
    const job = createSummaryJob({
      sql: world.sql,
      models,
      log: world.log,
      committer: createGroupCommitter({ sql: world.sql, log: world.log }),
      tasks,
      budgets,
      batches: intake,
    }, { budgetMs: 5_000, perCallTimeoutMs: 1_000, maxAttempts: 1 });
    return (jobId = crypto.randomUUID()) =>
      job({
        id: `${Date.now()}-0`,
        fields: { job_id: jobId, tenant: "acme", payload: batchPayload("Some text. More text.") },
        deliveries: 1,
      }, signal).catch((error: Error) => error.message);
  };
  const deliver = jobWith(world.intake);
  const poller = (onExpiry: "online" | "fail" = "online", online?: () => Promise<unknown>) =>
    createBatchPoller({ ...world, committer: createGroupCommitter({ sql: world.sql, log: world.log }) }, {
      onExpiry,
      prices: prices(),
      budgets,
      leaseMs: 0,
      online,
    });
  const view = async () =>
    Object.fromEntries(
      (await budgets.views("acme")).filter((v) => v.unit === "tokens").flatMap((v) => [
        [`spent`, v.spent],
        [`reserved`, v.reserved],
      ]),
    ) as { spent: number; reserved: number };
  return {
    world,
    r,
    keys,
    budgets,
    deliver,
    jobWith,
    poller,
    view,
    onlineCalls: () => online,
    async close() {
      await r.close();
      await world.close();
    },
  };
}

/** The worst case one batch run holds: a tenant with a large budget collects one run, and what it holds is read. */
async function worstOfOne(w: Awaited<ReturnType<typeof holdsWorld>>): Promise<number> {
  await setTenantBudget(w.world.sql, "acme", { "--tokens-per-day": 1_000_000 });
  const id = crypto.randomUUID();
  assert.equal(await w.deliver(id), "batched");
  const { reserved } = await w.view();
  // Released again, and its line taken out of the batch, so the test starts from nothing held.
  await w.budgets.settleHold("acme", id, { tokens: 0, nanos: 0 });
  await w.world.sql`DELETE FROM batch_runs`;
  await w.world.sql`DELETE FROM batches`;
  return reserved;
}

async function submitAndSettle(world: BatchWorld, poller: { runOnce(): Promise<number> }): Promise<void> {
  await createBatchSubmitter(world, { maxWaitMs: 0 }).runOnce();
  assert.equal(await poller.runOnce(), 1, "one batch settled");
}

async function lineStates(sql: Sql): Promise<string[]> {
  return (await sql<{ settled: string | null }[]>`SELECT settled FROM batch_runs ORDER BY run_id`)
    .map((r) => String(r.settled));
}

Deno.test("batch lines hold their worst case until they settle: the budget is never passed, then each is charged its usage", async () => {
  const w = await holdsWorld();
  try {
    const worst = await worstOfOne(w);
    assert.ok(worst > USAGE.prompt_tokens + USAGE.completion_tokens, `a worst case (${worst}) above the usage`);
    // Room for exactly two lines' worst cases.
    await setTenantBudget(w.world.sql, "acme", { "--tokens-per-day": 2 * worst + 1 });
    assert.equal(await w.deliver(), "batched");
    assert.equal(await w.deliver(), "batched");
    assert.deepEqual(await w.view(), { spent: 0, reserved: 2 * worst });
    // The third does not fit beside the two held: not collected, it goes online (where its reservation waits).
    assert.match(String(await w.deliver()), /online call 1|Budget|budget/);
    const [count] = await w.world.sql<{ n: number }[]>`SELECT count(*)::int AS n FROM batch_runs`;
    assert.equal(count!.n, 2, "two lines collected, not three");
    // Nor does an online call's worst case fit beside the holds.
    await assert.rejects(w.budgets.reserve("acme", MODEL, { prompt: 1, completion: 1 }), BudgetExhausted);
    // The batch runs; each line is charged its usage and its hold goes.
    await submitAndSettle(w.world, w.poller());
    assert.deepEqual(await w.view(), { spent: 2 * 15, reserved: 0 });
    // The output read again (a poller that died before `committed`): nothing more charged, nothing held again.
    await w.world.sql`UPDATE batches SET state = 'ended'`;
    await w.world.sql`UPDATE batch_runs SET settled = NULL`;
    assert.equal(await w.poller().runOnce(), 1);
    assert.deepEqual(await w.view(), { spent: 2 * 15, reserved: 0 });
    assert.equal(w.onlineCalls(), 1, "only the run that did not fit went online");
  } finally {
    await w.close();
  }
});

Deno.test("a hold is asked and settled twice (a resend, a redelivery) and counts once", async () => {
  const w = await holdsWorld();
  try {
    await setTenantBudget(w.world.sql, "acme", { "--tokens-per-day": 1_000_000 });
    const id = crypto.randomUUID();
    const first = await w.budgets.hold("acme", MODEL, { prompt: 100, completion: 50 }, id);
    const again = await w.budgets.hold("acme", MODEL, { prompt: 100, completion: 50 }, id);
    assert.deepEqual(first, again);
    assert.deepEqual(await w.view(), { spent: 0, reserved: 150 });
    // A redelivery of the run, its line recorded once: the run job's hold finds its own.
    const run = crypto.randomUUID();
    assert.equal(await w.deliver(run), "batched");
    const held = (await w.view()).reserved;
    assert.equal(await w.deliver(run), "batched");
    assert.equal((await w.view()).reserved, held);
    await w.budgets.settleHold("acme", id, { tokens: 40, nanos: 0 });
    await w.budgets.settleHold("acme", id, { tokens: 40, nanos: 0 });
    assert.deepEqual(await w.view(), { spent: 40, reserved: held - 150 });
  } finally {
    await w.close();
  }
});

Deno.test("a budget hash lost with lines in flight is rebuilt holding them, and each is still charged once", async () => {
  const w = await holdsWorld();
  try {
    const worst = await worstOfOne(w);
    await setTenantBudget(w.world.sql, "acme", { "--tokens-per-day": 3 * worst });
    for (let i = 0; i < 3; i++) assert.equal(await w.deliver(), "batched");
    assert.deepEqual(await w.view(), { spent: 0, reserved: 3 * worst });
    // Lost (a flush, a failover without persistence): the rebuild holds the three lines again, from batch_runs.
    await w.r.redis.del(w.keys.budget("acme"));
    assert.deepEqual(await w.view(), { spent: 0, reserved: 3 * worst });
    assert.match(String(await w.deliver()), /online call|udget/, "still full: a fourth is not collected");
    await submitAndSettle(w.world, w.poller());
    assert.deepEqual(await w.view(), { spent: 3 * 15, reserved: 0 });
    // Lost again after the commit: the rows are spend, and no line is held.
    await w.r.redis.del(w.keys.budget("acme"));
    assert.deepEqual(await w.view(), { spent: 3 * 15, reserved: 0 });
  } finally {
    await w.close();
  }
});

Deno.test("a hold's settlement that fails leaves its line for the next pass; a hash lost in between charges it once", async () => {
  const w = await holdsWorld();
  try {
    await setTenantBudget(w.world.sql, "acme", { "--tokens-per-day": 1_000_000 });
    const ids = [crypto.randomUUID(), crypto.randomUUID()];
    for (const id of ids) assert.equal(await w.deliver(id), "batched");
    const held = (await w.view()).reserved;
    // Redis out of the poller's reach: the first line's usage row is written, its hold's settlement fails, and the
    // pass stops there (as a crash between the two would leave it): the line is not settled, nor its run committed.
    let refuse = true;
    const budgets: Budgets = {
      ...w.budgets,
      settleHold: (...args) => refuse ? Promise.reject(new Error("Redis unreachable")) : w.budgets.settleHold(...args),
    };
    await createBatchSubmitter(w.world, { maxWaitMs: 0 }).runOnce();
    const poller = createBatchPoller({
      ...w.world,
      committer: createGroupCommitter({ sql: w.world.sql, log: w.world.log }),
    }, { onExpiry: "online", prices: prices(), budgets, leaseMs: 0 });
    await assert.rejects(poller.runOnce(), /Redis unreachable/);
    assert.deepEqual(await lineStates(w.world.sql), ["null", "null"]);
    const [rows] = await w.world.sql<{ n: number }[]>`SELECT count(*)::int AS n FROM model_attempts`;
    assert.equal(rows!.n, 1, "the first line's usage row is written");
    assert.deepEqual(await w.view(), { spent: 0, reserved: held }, "no hold settled yet");
    // The hash is lost now: the rebuild counts the first line's row as spend and holds only the second line.
    await w.r.redis.del(w.keys.budget("acme"));
    assert.deepEqual(await w.view(), { spent: 15, reserved: held / 2 });
    // Redis back: the next pass settles both lines, the first finding no hold (its row counted) and charging nothing.
    refuse = false;
    assert.equal(await poller.runOnce(), 1);
    assert.deepEqual(await lineStates(w.world.sql), ["committed", "committed"]);
    assert.deepEqual(await w.view(), { spent: 30, reserved: 0 });
  } finally {
    await w.close();
  }
});

Deno.test("a worker killed between the hold and the recording: the redelivery holds once; a hash rebuilt before the record's commit holds the line again", async () => {
  const w = await holdsWorld();
  try {
    const worst = await worstOfOne(w);
    await setTenantBudget(w.world.sql, "acme", { "--tokens-per-day": 1_000_000 });
    const key = w.keys.budget("acme");
    const run = crypto.randomUUID();
    const intake = w.world.intake;
    let crash = true;
    const job = w.jobWith({
      ...intake,
      record: async (r) => {
        // The first delivery dies between its hold and its record.
        if (crash) throw new Error("killed before the record");
        // The hash lost and rebuilt by another process just before this record commits: its snapshot has no line.
        await w.r.redis.del(key);
        assert.deepEqual(await w.view(), { spent: 0, reserved: 0 }, "the rebuild saw no line to hold");
        return await intake.record(r);
      },
    });
    assert.match(String(await job(run)), /killed before the record/);
    assert.deepEqual(await w.view(), { spent: 0, reserved: worst });
    crash = false;
    assert.equal(await job(run), "batched");
    // Held again once recorded (it was lost in the rebuild), once.
    assert.deepEqual(await w.view(), { spent: 0, reserved: worst });
    // A third delivery (its ack lost) finds the run recorded, and holds nothing more.
    assert.equal(await w.deliver(run), "batched");
    assert.deepEqual(await w.view(), { spent: 0, reserved: worst });
    const [row] = await w.world.sql<{ held: string }[]>`SELECT held_tokens::text AS held FROM batch_runs`;
    assert.equal(Number(row!.held), worst);
  } finally {
    await w.close();
  }
});

Deno.test("the sweep releases holds no line in flight stands behind, and leaves live ones", async () => {
  const w = await holdsWorld();
  try {
    await setTenantBudget(w.world.sql, "acme", { "--tokens-per-day": 1_000_000 });
    // A hold whose run was never recorded (its worker killed between the two, the run cancelled meanwhile).
    const orphan = crypto.randomUUID();
    await w.budgets.hold("acme", MODEL, { prompt: 1000, completion: 0 }, orphan);
    // A line left out of its batch (cancelled before the upload): settled `left_out`, its hold still there.
    const leftOut = crypto.randomUUID();
    assert.equal(await w.deliver(leftOut), "batched");
    const one = (await w.view()).reserved - 1000;
    await w.world.sql`UPDATE batch_runs SET settled = 'left_out', in_file = false WHERE run_id = ${leftOut}::uuid`;
    // A line in flight.
    assert.equal(await w.deliver(), "batched");
    assert.deepEqual(await w.view(), { spent: 0, reserved: 1000 + 2 * one });
    // Not old enough: the sweep looks at nothing.
    assert.equal(await w.budgets.sweepHolds({ olderThanMs: 60_000 }), 0);
    await new Promise((resolve) => setTimeout(resolve, 5));
    assert.equal(await w.budgets.sweepHolds({ olderThanMs: 0 }), 2);
    assert.deepEqual(await w.view(), { spent: 0, reserved: one });
    assert.equal(await w.budgets.sweepHolds({ olderThanMs: 0 }), 0, "a second sweep finds nothing to do");
  } finally {
    await w.close();
  }
});

Deno.test("a hold renewed after the sweep read it is not released by the sweep", async () => {
  const r = await createTestRedis();
  try {
    const key = serviceKeys(r.prefix).budget("acme");
    await seedBudgetState(r.redis, key, [0, 0, 0, 0]);
    const limits = [-1, -1, -1, -1] as [number, number, number, number];
    await runHold(r.redis, key, limits, { tokens: 100, nanos: 0 }, { id: "x" });
    const [read] = await heldIn(r.redis, key);
    await new Promise((resolve) => setTimeout(resolve, 5));
    // A redelivery holds it again (renewed), then the sweep settles the hold it read: nothing is done.
    await runHold(r.redis, key, limits, { tokens: 100, nanos: 0 }, { id: "x" });
    const stale = await runSettleHold(r.redis, key, "x", { tokens: 0, nanos: 0 }, limits, { at: read!.atMs });
    assert.equal(stale.applied, false);
    assert.equal(await r.redis.hget(key, "bh:tok"), "100");
    const [renewed] = await heldIn(r.redis, key);
    const current = await runSettleHold(r.redis, key, "x", { tokens: 0, nanos: 0 }, limits, { at: renewed!.atMs });
    assert.equal(current.applied, true);
    assert.equal(await r.redis.hget(key, "bh:tok"), "0");
  } finally {
    await r.close();
  }
});

Deno.test("`tenant budget` run on a lost hash rebuilds it with the lines in flight held", async () => {
  const w = await holdsWorld();
  try {
    const worst = await worstOfOne(w);
    await setTenantBudget(w.world.sql, "acme", { "--tokens-per-day": 1_000_000 });
    for (let i = 0; i < 2; i++) assert.equal(await w.deliver(), "batched");
    await w.r.redis.del(w.keys.budget("acme"));
    const out: string[] = [];
    const code = await tenantCommand(w.world.sql, ["budget", "acme", "--tokens-per-day", "2000000"], (line) => {
      out.push(String(line));
    }, { redis: w.r.redis, prefix: w.r.prefix, records: budgetRecords(w.world.sql) });
    assert.equal(code, 0, out.join("\n"));
    assert.deepEqual(await w.view(), { spent: 0, reserved: 2 * worst });
    await submitAndSettle(w.world, w.poller());
    assert.deepEqual(await w.view(), { spent: 30, reserved: 0 });
  } finally {
    await w.close();
  }
});

Deno.test("a line that goes online gives its hold back first, and a failed line charges nothing", async () => {
  const w = await holdsWorld({
    script: () => ({
      end: "expired",
      line: (_id, _body, i) =>
        i === 0
          ? { kind: "ok", usage: USAGE }
          : i === 1
          ? { kind: "error", status: 400, message: "bad request" }
          : { kind: "unfinished" },
    }),
  });
  try {
    await setTenantBudget(w.world.sql, "acme", { "--tokens-per-day": 1_000_000 });
    for (let i = 0; i < 3; i++) assert.equal(await w.deliver(), "batched");
    // The online send sees what its run holds at that moment: its own hold must already be gone.
    const heldAtSend: number[] = [];
    const online = async () => {
      heldAtSend.push((await w.view()).reserved);
    };
    await submitAndSettle(w.world, w.poller("online", online));
    assert.deepEqual((await lineStates(w.world.sql)).sort(), ["committed", "failed", "online"]);
    assert.deepEqual(heldAtSend, [0], "the unfinished line's hold was released before it went online");
    assert.deepEqual(await w.view(), { spent: 15, reserved: 0 });
  } finally {
    await w.close();
  }
});

Deno.test("a rebuild seed leaves a hash seeded meanwhile as it is (the first snapshot stands whole)", async () => {
  const r = await createTestRedis();
  try {
    const key = serviceKeys(r.prefix).budget("acme");
    await seedBudgetState(r.redis, key, [100, 0, 100, 0], {
      holds: [{ id: "a", tokens: 50, nanos: 0 }],
      rebuild: true,
    });
    // A later snapshot (line a charged since: its row counted, no longer held) arrives second: it changes nothing.
    await seedBudgetState(r.redis, key, [150, 0, 150, 0], { holds: [], rebuild: true });
    assert.equal(await r.redis.hget(key, "B:a") !== null, true);
    assert.equal(await r.redis.hget(key, "bh:tok"), "50");
    const day = Math.floor(Date.now() / 86_400_000);
    assert.equal(await r.redis.hget(key, `d${day}:tok`), "100");
    // A budget set (not a rebuild) still raises the spend to the record's, and holds nothing new.
    await seedBudgetState(r.redis, key, [150, 0, 150, 0], { holds: [{ id: "b", tokens: 9, nanos: 0 }] });
    assert.equal(await r.redis.hget(key, `d${day}:tok`), "150");
    assert.equal(await r.redis.hget(key, "B:b"), null);
  } finally {
    await r.close();
  }
});
