import type { Sql } from "postgres";
import type { BudgetRecords } from "../budgets/budgets.ts";
import { chargedThisPeriod } from "../jobs/job_store.ts";
import { loadTenantBudgets } from "../tenants/tenant_budgets.ts";
import { heldLines, lineVerdicts } from "../batches/batch_store.ts";

/**
 * What the budgets read from Postgres, from the stores that own it: limits from `tenants`, spend from
 * `model_attempts`, batch lines' holds from `batch_runs`.
 */
export function budgetRecords(sql: Sql): BudgetRecords {
  return {
    limits: () => loadTenantBudgets(sql),
    // One snapshot: a batch line is either charged in the spend (its model_attempts row) or held, never both.
    spent: (tenant) =>
      sql.begin("isolation level repeatable read read only", async (tx) => ({
        ...await chargedThisPeriod(tx, tenant),
        holds: await heldLines(tx, tenant),
      })),
    holdVerdicts: (ids) => lineVerdicts(sql, ids),
  };
}
