/**
 * Budget writes applied twice, as ioredis applies them when a reply is lost
 * with its connection: it resends every unanswered command after it
 * reconnects, and Redis may already have run it. Each case runs the same
 * script with the same arguments twice and asserts the hash is as after one.
 * The cases run back to back on one tenant's hash, as production would.
 */
import assert from "node:assert/strict";
import { ReservationNotReplicated, seedFromRecord } from "../../src/budgets/budgets.ts";
import { afterEachScript } from "../support/resending_redis.ts";
import type { Limits } from "../../src/budgets/budget_hash.ts";
import { readBudgetState } from "../../src/budgets/read_script.ts";
import { runReserve } from "../../src/budgets/reserve_script.ts";
import { runSettle } from "../../src/budgets/settle_script.ts";
import { seedBudgetState } from "../../src/budgets/seed_script.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { budgetRecords, budgetsOn } from "../support/fixtures.ts";
import { createReplicaAck } from "../../src/redis/replica_ack.ts";
import { createPrices } from "../../src/llm/prices.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { setTenantBudget } from "../../src/tenants/tenant_budgets.ts";
import { createTestDatabase, createTestRedis } from "../_support.ts";

const LIMITS: Limits = [1_000, -1, -1, -1];
const worst = (tokens: number) => ({ tokens, nanos: 0 });

Deno.test("budget scripts applied twice (a resend after a lost reply) change the budget once", async (t) => {
  const r = await createTestRedis();
  const key = serviceKeys(r.prefix).budget("twice");
  const state = async () => {
    const s = await readBudgetState(r.redis, key);
    return { spent: s.spent[0], reserved: s.reserved[0] };
  };
  try {
    await seedBudgetState(r.redis, key, [0, 0, 0, 0]);
    await t.step("a reserve run twice holds one reservation, and answers the second run as the first", async () => {
      const id = crypto.randomUUID();
      const first = await runReserve(r.redis, key, LIMITS, worst(600), { id });
      const again = await runReserve(r.redis, key, LIMITS, worst(600), { id });
      // 600 + 600 would pass 1,000: a second hold would have been refused, and a phantom one kept.
      assert.equal(first.ok, true);
      assert.equal(again.ok, true, "the resend is answered as the reservation it finds");
      assert.equal(again.epoch, first.epoch);
      assert.deepEqual(await state(), { spent: 0, reserved: 600 });
      await runSettle(r.redis, key, { epoch: first.epoch, inc: first.inc, id }, worst(600), worst(0), LIMITS);
      assert.deepEqual(await state(), { spent: 0, reserved: 0 });
    });

    await t.step("a settle run twice charges once and removes only its own reservation", async () => {
      const a = await runReserve(r.redis, key, LIMITS, worst(300));
      const b = await runReserve(r.redis, key, LIMITS, worst(400));
      assert.ok(a.ok && b.ok);
      const settleA = () => runSettle(r.redis, key, a, worst(300), worst(100), LIMITS);
      assert.equal((await settleA()).applied, true);
      assert.deepEqual(await state(), { spent: 100, reserved: 400 });
      assert.equal((await settleA()).applied, false, "the second run finds nothing left to settle");
      // Before ids, the repeat charged 100 again and took 300 off b's reservation (spent 200, reserved 100).
      assert.deepEqual(await state(), { spent: 100, reserved: 400 });
      await runSettle(r.redis, key, b, worst(400), worst(150), LIMITS);
      await runSettle(r.redis, key, b, worst(400), worst(150), LIMITS);
      assert.deepEqual(await state(), { spent: 250, reserved: 0 });
    });

    await t.step("a settle of a lost hash's reservation, run twice, charges it once in the rebuilt hash", async () => {
      const held = await runReserve(r.redis, key, LIMITS, worst(500));
      assert.ok(held.ok);
      await r.redis.del(key);
      // Settled before the rebuild: nothing is written (the seed would overwrite it), and the caller seeds first.
      assert.equal((await runSettle(r.redis, key, held, worst(500), worst(120), LIMITS)).unseeded, true);
      assert.equal(await r.redis.exists(key), 0);
      await seedBudgetState(r.redis, key, [0, 0, 0, 0]);
      const settle = () => runSettle(r.redis, key, held, worst(500), worst(120), LIMITS);
      assert.equal((await settle()).applied, true);
      assert.equal((await settle()).applied, false);
      assert.deepEqual(await state(), { spent: 120, reserved: 0 });
    });
  } finally {
    await r.close();
  }
});

Deno.test("a reservation too few replicas acknowledged is released, and its call does not go out", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  // The test Redis has no replica: WAIT 1 never reaches one.
  const ack = createReplicaAck(r.redis, { replicas: 1, timeoutMs: 50 });
  try {
    await createApiKey(db.sql, "acme");
    await setTenantBudget(db.sql, "acme", { "--tokens-per-day": 10_000 });
    const keys = serviceKeys(r.prefix);
    const budgets = budgetsOn({ redis: r.redis, sql: db.sql, keys, ack }, { prices: createPrices({}) });
    await assert.rejects(budgets.reserve("acme", "m", { prompt: 100, completion: 50 }), ReservationNotReplicated);
    const s = await readBudgetState(r.redis, keys.budget("acme"));
    assert.deepEqual([s.spent[0], s.reserved[0]], [0, 0], "released, and charged nothing");
  } finally {
    await ack.close();
    await r.close();
    await db.close();
  }
});

Deno.test("another process's call in flight when the hash is lost is held again once that process sees the rebuild", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  try {
    await createApiKey(db.sql, "acme");
    await setTenantBudget(db.sql, "acme", { "--tokens-per-day": 1_000 });
    const keys = serviceKeys(r.prefix);
    const make = () => budgetsOn({ redis: r.redis, sql: db.sql, keys }, { prices: createPrices({}) });
    const one = make();
    const two = make();
    const key = keys.budget("acme");
    // Process one has two calls in flight (300 + 300); the hash is lost and rebuilt by process two's reservation.
    const first = (await one.reserve("acme", "m", { prompt: 250, completion: 50 }))!;
    await one.reserve("acme", "m", { prompt: 250, completion: 50 });
    await r.redis.del(key);
    const other = (await two.reserve("acme", "m", { prompt: 50, completion: 50 }))!;
    assert.equal((await readBudgetState(r.redis, key)).reserved[0], 100);
    // One of process one's calls ends: its settlement sees another incarnation, and the other call is held again.
    await first.settle({ value: { text: "x", usage: { prompt_tokens: 200, completion_tokens: 40 } } } as never);
    const s = await readBudgetState(r.redis, key);
    assert.deepEqual([s.spent[0], s.reserved[0]], [240, 400]);
    // So 1,000 - 240 - 400 = 360 is left: 400 more does not fit.
    await assert.rejects(two.reserve("acme", "m", { prompt: 350, completion: 50 }), /budget/i);
    await other.settle({ value: { text: "x", usage: { prompt_tokens: 50, completion_tokens: 10 } } } as never);
  } finally {
    await r.close();
    await db.close();
  }
});

Deno.test("a reserve that ran though its caller heard an error is asked again with its id, or released", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  try {
    await createApiKey(db.sql, "acme");
    await setTenantBudget(db.sql, "acme", { "--tokens-per-day": 10_000 });
    const keys = serviceKeys(r.prefix);
    await seedFromRecord({ redis: r.redis, keys, records: budgetRecords(db.sql) }, "acme");
    // The next `failures` scripts run in Redis, and their callers hear an error instead of the reply: a reply lost
    // with its connection, or a command ioredis aborted behind it in a pipeline ("Command aborted due to
    // connection close"), after Redis had run it.
    let failures = 0;
    const faulty = afterEachScript(r.redis, () => {
      if (failures <= 0) return Promise.resolve();
      failures--;
      return Promise.reject(new Error("Command aborted due to connection close"));
    });
    const budgets = budgetsOn({ redis: faulty, sql: db.sql, keys }, { prices: createPrices({}) });
    const reserved = async () => (await readBudgetState(r.redis, keys.budget("acme"))).reserved[0];

    // One lost reply: asked again with the same id, it finds its own reservation; held once, not twice.
    failures = 1;
    const held = await budgets.reserve("acme", "m", { prompt: 100, completion: 50 });
    assert.ok(held);
    assert.equal(await reserved(), 150);
    await held.settle({ value: { text: "x", usage: { prompt_tokens: 100, completion_tokens: 10 } } } as never);
    assert.equal(await reserved(), 0);

    // Every try lost: the call does not go out, and the reservation that ran is released (before, it held the
    // budget until its epoch ended, then was charged whole).
    failures = 3;
    await assert.rejects(budgets.reserve("acme", "m", { prompt: 100, completion: 50 }), /aborted/);
    const s = await readBudgetState(r.redis, keys.budget("acme"));
    assert.deepEqual([s.spent[0], s.reserved[0]], [110, 0]);
  } finally {
    await r.close();
    await db.close();
  }
});

Deno.test("a settlement that comes first after the hash is lost is charged on top of the rebuilt spend", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  try {
    await createApiKey(db.sql, "acme");
    await setTenantBudget(db.sql, "acme", { "--tokens-per-day": 10_000 });
    await db.sql`INSERT INTO model_attempts
      (job_id, tenant, delivery, attempt, started_at, duration_ms, outcome, prompt_tokens, completion_tokens, model)
      VALUES (${crypto.randomUUID()}, 'acme', 1, 1, now(), 10, 'ok', 600, 200, 'm')`;
    const keys = serviceKeys(r.prefix);
    const budgets = budgetsOn({ redis: r.redis, sql: db.sql, keys }, { prices: createPrices({}) });
    const key = keys.budget("acme");
    const held = (await budgets.reserve("acme", "m", { prompt: 1000, completion: 2000 }))!;
    await r.redis.del(key);
    // The call's settlement is the first to touch the lost hash (its attempt row is not written yet). Before, it
    // charged 1,100 into the empty hash, and the seed then raised spend to the record's 800 only if more: 1,100.
    await held.settle({ value: { text: "x", usage: { prompt_tokens: 1000, completion_tokens: 100 } } } as never);
    const s = await readBudgetState(r.redis, key);
    assert.deepEqual([s.spent[0], s.reserved[0], s.seeded], [1900, 0, true]);
  } finally {
    await r.close();
    await db.close();
  }
});
