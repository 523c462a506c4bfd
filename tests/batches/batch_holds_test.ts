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
import { createPrices } from "../../src/llm/prices.ts";
import type { Models } from "../../src/llm/models.ts";
import { createGroupCommitter } from "../../src/runs/commit.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createSummaryJob } from "../../src/runs/run_job.ts";
import { SUMMARIZE_TASK, type TaskCache } from "../../src/tasks/task_cache.ts";
import { setTenantBudget } from "../../src/tenants/tenant_budgets.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { budgetsOn } from "../support/fixtures.ts";
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
  const job = createSummaryJob({
    sql: world.sql,
    models,
    log: world.log,
    committer: createGroupCommitter({ sql: world.sql, log: world.log }),
    tasks,
    budgets,
    batches: world.intake,
  }, { budgetMs: 5_000, perCallTimeoutMs: 1_000, maxAttempts: 1 });
  const signal = new AbortController().signal;
  /** Delivers a batch run of `acme` to the job: "batched", or the online call's error (it went online). */
  const deliver = (jobId = crypto.randomUUID()) =>
    job({
      id: `${Date.now()}-0`,
      fields: { job_id: jobId, tenant: "acme", payload: batchPayload("Some text. More text.") },
      deliveries: 1,
    }, signal).catch((error: Error) => error.message);
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

Deno.test("a hash lost between a line's usage row and its hold's settlement charges the line once", async () => {
  const w = await holdsWorld();
  try {
    await setTenantBudget(w.world.sql, "acme", { "--tokens-per-day": 1_000_000 });
    const ids = [crypto.randomUUID(), crypto.randomUUID()];
    for (const id of ids) assert.equal(await w.deliver(id), "batched");
    const held = (await w.view()).reserved;
    // The poller stops right after the first line's model_attempts row is written (its budget charge fails: Redis
    // is not reached), as a crash between the two would leave it.
    let refuse = true;
    const budgets: Budgets = {
      ...w.budgets,
      settleHold: (...args) => refuse ? Promise.reject(new Error("Redis unreachable")) : w.budgets.settleHold(...args),
    };
    await createBatchSubmitter(w.world, { maxWaitMs: 0 }).runOnce();
    const poller = createBatchPoller({
      ...w.world,
      committer: createGroupCommitter({ sql: w.world.sql, log: w.world.log }),
    }, {
      onExpiry: "online",
      prices: prices(),
      budgets,
      leaseMs: 0,
    });
    assert.equal(await poller.runOnce(), 1);
    refuse = false;
    assert.deepEqual(await w.view(), { spent: 0, reserved: held }, "rows written, holds not settled");
    // The hash is lost now: the rebuild counts the two rows as spend and holds neither line again.
    await w.r.redis.del(w.keys.budget("acme"));
    assert.deepEqual(await w.view(), { spent: 30, reserved: 0 });
    // The settlements that failed, asked again, find no hold and charge nothing more.
    for (const id of ids) await w.budgets.settleHold("acme", id, { tokens: 15, nanos: 0 });
    assert.deepEqual(await w.view(), { spent: 30, reserved: 0 });
  } finally {
    await w.close();
  }
});

Deno.test("the sweep releases a hold no line stands behind, charges one whose line was charged, and keeps a live one", async () => {
  const w = await holdsWorld();
  try {
    await setTenantBudget(w.world.sql, "acme", { "--tokens-per-day": 1_000_000 });
    // A hold whose run was never recorded (its worker killed between the two, the run cancelled meanwhile).
    const orphan = crypto.randomUUID();
    await w.budgets.hold("acme", MODEL, { prompt: 1000, completion: 0 }, orphan);
    // Two lines collected; the batch runs, but the budget charge of both fails (Redis unreachable to the poller).
    const lines = [crypto.randomUUID(), crypto.randomUUID()];
    for (const id of lines) assert.equal(await w.deliver(id), "batched");
    // One more collected after the batch closed: live in the next batch.
    const held = (await w.view()).reserved;
    const budgets: Budgets = { ...w.budgets, settleHold: () => Promise.reject(new Error("Redis unreachable")) };
    await createBatchSubmitter(w.world, { maxWaitMs: 0 }).runOnce();
    const poller = createBatchPoller({
      ...w.world,
      committer: createGroupCommitter({ sql: w.world.sql, log: w.world.log }),
    }, {
      onExpiry: "online",
      prices: prices(),
      budgets,
      leaseMs: 0,
    });
    assert.equal(await poller.runOnce(), 1);
    assert.deepEqual(await lineStates(w.world.sql), ["committed", "committed"]);
    const live = crypto.randomUUID();
    assert.equal(await w.deliver(live), "batched");
    const liveHeld = (await w.view()).reserved - held;
    // Not yet old enough: the sweep looks at nothing.
    assert.equal(await w.budgets.sweepHolds({ olderThanMs: 60_000 }), 0);
    // Old enough: the orphan released, the two lines charged at their rows (15 tokens each), the live one kept.
    assert.equal(await w.budgets.sweepHolds({ olderThanMs: 0 }), 3);
    assert.deepEqual(await w.view(), { spent: 30, reserved: liveHeld });
    assert.equal(await w.budgets.sweepHolds({ olderThanMs: 0 }), 0, "a second sweep finds nothing to do");
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
