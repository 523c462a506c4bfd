/**
 * The budget hash's calendar: the day comes from Redis's clock, the month a
 * day is in from the caller's ({@linkcode periodsAt}). A script asked about
 * another day than Redis's writes nothing and is asked again about Redis's,
 * so a host whose clock is off charges the right day and month.
 */
import assert from "node:assert/strict";
import { monthOfDay, periodsAt } from "../../src/budgets/budget_hash.ts";
import { readBudgetState } from "../../src/budgets/read_script.ts";
import { runReserve } from "../../src/budgets/reserve_script.ts";
import { runSettle } from "../../src/budgets/settle_script.ts";
import { seedBudgetState } from "../../src/budgets/seed_script.ts";
import { reinstateReservations } from "../../src/budgets/reinstate_script.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createTestRedis } from "../_support.ts";

const DAY_MS = 86_400_000;
const day = (iso: string) => Date.parse(iso) / DAY_MS;

Deno.test("periodsAt names the day, its month (year * 12 + month - 1) and the first days around it", () => {
  // At the start of a month after a leap February, and at the last millisecond of a year.
  for (
    const [at, today, month, prev, first, next] of [
      ["2024-03-01T00:00:00Z", "2024-03-01", 2024 * 12 + 2, "2024-02-01", "2024-03-01", "2024-04-01"],
      ["2025-12-31T23:59:59.999Z", "2025-12-31", 2025 * 12 + 11, "2025-11-01", "2025-12-01", "2026-01-01"],
    ] as const
  ) {
    assert.deepEqual(periodsAt(Date.parse(at)), {
      day: day(today),
      month,
      prev_month_first: day(prev),
      month_first: day(first),
      next_month_first: day(next),
    });
  }
  assert.equal(monthOfDay(day("2024-02-29")), 2024 * 12 + 1);
  assert.equal(monthOfDay(day("2000-01-01")), 2000 * 12);
  assert.equal(monthOfDay(0), 1970 * 12);
});

Deno.test("budget scripts asked about another day than Redis's write nothing for it, and are asked about Redis's", async () => {
  const r = await createTestRedis();
  const key = serviceKeys(r.prefix).budget("skewed");
  const realNow = Date.now;
  // This host's clock is two days behind Redis's.
  Date.now = () => realNow() - 2 * DAY_MS;
  try {
    const limits: [number, number, number, number] = [1_000, -1, 1_000, -1];
    await seedBudgetState(r.redis, key, [5, 0, 5, 0]);
    const held = await runReserve(r.redis, key, limits, { tokens: 100, nanos: 0 });
    assert.ok(held.ok);
    const today = Math.floor(realNow() / DAY_MS);
    assert.equal(held.day, today, "the reservation is Redis's day's");
    let state = await readBudgetState(r.redis, key);
    assert.deepEqual([state.day, state.spent, state.reserved], [today, [5, 0, 5, 0], [100, 0, 100, 0]]);
    const settled = await runSettle(r.redis, key, held, { tokens: 100, nanos: 0 }, { tokens: 40, nanos: 0 }, limits);
    assert.deepEqual([settled.applied, settled.spent, settled.reserved], [true, [45, 0, 45, 0], [0, 0, 0, 0]]);
    // Held again after a loss, in Redis's current epoch.
    await reinstateReservations(r.redis, key, [{ id: "other", tok: 10, usd: 0, inc: "gone" }]);
    state = await readBudgetState(r.redis, key);
    assert.deepEqual([state.spent[0], state.reserved[0], state.month], [45, 10, monthOfDay(today)]);
    // Nothing was written under the day (or month) this host's clock named.
    const fields = await r.redis.hkeys(key);
    const wrong = periodsAt(Date.now());
    assert.equal(fields.filter((f) => f.startsWith(`d${wrong.day}:`)).length, 0, fields.join(" "));
    assert.ok(fields.includes(`d${today}:tok`));
    if (wrong.month !== monthOfDay(today)) assert.ok(!fields.some((f) => f.startsWith(`m${wrong.month}:`)));
  } finally {
    Date.now = realNow;
    await r.close();
  }
});
