/** A refused call's 429 says what did not fit: the worst case against what was left (issue 37). */
import assert from "node:assert/strict";
import { BudgetExhausted } from "../../src/budgets/budgets.ts";

Deno.test("the refusal names what is left and the worst case that did not fit, not only what is spent", () => {
  const now = Date.UTC(2026, 11, 6, 12);
  const tokens = new BudgetExhausted(
    "acme",
    { period: "day", unit: "tokens", limit: 1_300, spent: 244 },
    now + 3_600_000,
    now,
    { tokens: 1_100, nanos: 0 },
  );
  assert.equal(
    tokens.message,
    "tenant acme's token budget per day has 1056 tokens left of 1300 tokens (244 spent or held by calls under way), " +
      "less than the call's worst case of 1100 tokens (its prompt and every output token it may write)",
  );
  const usd = new BudgetExhausted(
    "acme",
    { period: "month", unit: "usd", limit: 5, spent: 4.9995 },
    now + 3_600_000,
    now,
    { tokens: 1_100, nanos: 1_250_000 },
  );
  assert.match(usd.message, /has 0\.0005 USD left of 5 USD .* worst case of 0\.00125 USD/);
});
