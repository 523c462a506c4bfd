import type { Sql } from "postgres";
import type { BudgetRecords } from "../budgets/budgets.ts";
import { chargedThisPeriod } from "../jobs/job_store.ts";
import { loadTenantBudgets } from "../tenants/tenant_budgets.ts";

/** What the budgets read from Postgres, from the stores that own it: limits from `tenants`, spend from `model_attempts`. */
export function budgetRecords(sql: Sql): BudgetRecords {
  return {
    limits: () => loadTenantBudgets(sql),
    spent: (tenant) => chargedThisPeriod(sql, tenant),
  };
}
