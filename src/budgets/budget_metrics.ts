import { Counter, Gauge, type Registry } from "prom-client";
import { nanosToUsd } from "../llm/prices.ts";
import { type BudgetEvents, BUDGETS } from "./budgets.ts";

const registered = new WeakMap<Registry, BudgetEvents>();

/**
 * The budgets' metrics on `registry` (once per registry: `dev` runs the API and the worker on one):
 * spend and reservations per tenant and budget (as the last settlement in this process saw them), the 80%
 * and 100% marks, and refusals by where they happened.
 */
export function budgetEvents(registry: Registry): BudgetEvents {
  const known = registered.get(registry);
  if (known) return known;
  const registers = [registry];
  const labelNames = ["tenant", "period", "unit"] as const;
  const spent = new Gauge({
    name: "oncely_budget_spent",
    help: "A tenant's spend in the current period (USD or tokens), as of this process's last settlement.",
    labelNames,
    registers,
  });
  const reserved = new Gauge({
    name: "oncely_budget_reserved",
    help: "A tenant's reservations in flight in the current period (USD or tokens).",
    labelNames,
    registers,
  });
  const thresholds = new Counter({
    name: "oncely_budget_threshold_reached_total",
    help: "Budgets that reached 80% or 100% of their limit (once per period and budget).",
    labelNames: ["tenant", "period", "unit", "percent"] as const,
    registers,
  });
  const refusals = new Counter({
    name: "oncely_budget_refusals_total",
    help: "Runs refused for a spent budget: at intake (429) or in a worker (deferred).",
    labelNames: ["tenant", "where"] as const,
    registers,
  });
  const events: BudgetEvents = {
    state(tenant, s, r) {
      BUDGETS.forEach(({ period, unit }, i) => {
        const show = (n: number) => unit === "usd" ? nanosToUsd(n) : n;
        spent.set({ tenant, period, unit }, show(s[i]!));
        reserved.set({ tenant, period, unit }, show(r[i]!));
      });
    },
    threshold(tenant, { period, unit }, percent) {
      thresholds.inc({ tenant, period, unit, percent: String(percent) });
    },
    refused(tenant, where) {
      refusals.inc({ tenant, where });
    },
  };
  registered.set(registry, events);
  return events;
}
