/**
 * The tenants store's budget columns: the limits `tenant budget` sets (`budget_usd_day`, `budget_usd_month`,
 * `budget_tokens_day`, `budget_tokens_month`), and the one read of every tenant's limits the budgets make.
 */
import type { Sql } from "postgres";
import type { Queryable } from "../db/queryable.ts";
import type { TenantBudget } from "../budgets/budgets.ts";

/** The `tenant budget` flags and the tenants columns they set. */
export const BUDGET_FLAGS = {
  "--usd-per-day": { column: "budget_usd_day", field: "usd_per_day", unit: "usd" },
  "--usd-per-month": { column: "budget_usd_month", field: "usd_per_month", unit: "usd" },
  "--tokens-per-day": { column: "budget_tokens_day", field: "tokens_per_day", unit: "tokens" },
  "--tokens-per-month": { column: "budget_tokens_month", field: "tokens_per_month", unit: "tokens" },
} as const;

export type BudgetFlag = keyof typeof BUDGET_FLAGS;

/** A change to a tenant's budgets: a flag's new limit, or null to clear it. */
export type BudgetChange = Partial<Record<BudgetFlag, number | null>>;

/**
 * Parses `--usd-per-day X --tokens-per-month N ...` (also `--flag=X`; `none` clears one) or `--none` (clears
 * every one). @throws {TypeError} naming the bad flag or value.
 */
export function parseBudgetArgs(args: string[]): BudgetChange {
  if (args.length === 1 && args[0] === "--none") {
    return Object.fromEntries(Object.keys(BUDGET_FLAGS).map((flag) => [flag, null])) as BudgetChange;
  }
  const change: BudgetChange = {};
  for (let i = 0; i < args.length; i++) {
    const arg = args[i]!;
    const eq = arg.indexOf("=");
    const flag = (eq < 0 ? arg : arg.slice(0, eq)) as BudgetFlag;
    if (!Object.hasOwn(BUDGET_FLAGS, flag)) {
      throw new TypeError(
        `Unknown budget flag ${JSON.stringify(arg)} (${Object.keys(BUDGET_FLAGS).join(", ")}, or --none)`,
      );
    }
    const value = eq < 0 ? args[++i] : arg.slice(eq + 1);
    if (value === undefined) throw new TypeError(`${flag} needs a value (a limit, or none)`);
    if (value === "none") {
      change[flag] = null;
      continue;
    }
    const { unit } = BUDGET_FLAGS[flag];
    const ok = unit === "usd" ? /^\d{1,9}(\.\d{1,9})?$/.test(value) : /^\d{1,15}$/.test(value);
    if (!ok) {
      throw new TypeError(
        `${flag} must be ${unit === "usd" ? "an amount of USD, such as 25 or 0.50" : "a whole number of tokens"}` +
          ` (got ${JSON.stringify(value)})`,
      );
    }
    change[flag] = Number(value);
  }
  return change;
}

/** Applies a change. @returns the tenant's budget after it, or null when there is no such tenant. */
export async function setTenantBudget(sql: Sql, tenant: string, change: BudgetChange): Promise<TenantBudget | null> {
  const set: Record<string, number | null> = {};
  for (const [flag, value] of Object.entries(change)) set[BUDGET_FLAGS[flag as BudgetFlag].column] = value;
  const rows = Object.keys(set).length === 0
    ? await sql`SELECT budget_usd_day, budget_usd_month, budget_tokens_day, budget_tokens_month
        FROM tenants WHERE name = ${tenant}`
    : await sql`UPDATE tenants SET ${sql(set)} WHERE name = ${tenant}
        RETURNING budget_usd_day, budget_usd_month, budget_tokens_day, budget_tokens_month`;
  if (rows.length === 0) return null;
  const row = rows[0]!;
  const budget: TenantBudget = {};
  for (const { column, field } of Object.values(BUDGET_FLAGS)) {
    if (row[column] !== null) budget[field] = Number(row[column]);
  }
  return budget;
}

/** Every tenant's limits, for the tenants that have any (the budgets read them through `BudgetRecords.limits`). */
export async function loadTenantBudgets(sql: Sql): Promise<Map<string, TenantBudget>> {
  const rows = await sql<
    {
      name: string;
      usd_day: string | null;
      usd_month: string | null;
      tok_day: string | null;
      tok_month: string | null;
    }[]
  >`
    SELECT name, budget_usd_day::text AS usd_day, budget_usd_month::text AS usd_month,
      budget_tokens_day::text AS tok_day, budget_tokens_month::text AS tok_month
    FROM tenants
    WHERE budget_usd_day IS NOT NULL OR budget_usd_month IS NOT NULL
      OR budget_tokens_day IS NOT NULL OR budget_tokens_month IS NOT NULL`;
  const num = (v: string | null) => v === null ? undefined : Number(v);
  return new Map(rows.map((r) => [r.name, {
    ...(r.usd_day === null ? {} : { usd_per_day: num(r.usd_day) }),
    ...(r.usd_month === null ? {} : { usd_per_month: num(r.usd_month) }),
    ...(r.tok_day === null ? {} : { tokens_per_day: num(r.tok_day) }),
    ...(r.tok_month === null ? {} : { tokens_per_month: num(r.tok_month) }),
  }]));
}

/** A tenant's spending limits (`tenant budget`); null where it has none. */
export interface TenantBudgets {
  budget_usd_day: string | null;
  budget_usd_month: string | null;
  budget_tokens_day: number | null;
  budget_tokens_month: number | null;
}

/** `tenant`'s budgets; all null for a tenant with none, or with no row (trusted-header tenants). */
export async function tenantBudgets(sql: Queryable, tenant: string): Promise<TenantBudgets> {
  const [row] = await sql<TenantBudgets[]>`
    SELECT budget_usd_day::text, budget_usd_month::text, budget_tokens_day::float8 AS budget_tokens_day,
      budget_tokens_month::float8 AS budget_tokens_month
    FROM tenants WHERE name = ${tenant}`;
  return row ?? { budget_usd_day: null, budget_usd_month: null, budget_tokens_day: null, budget_tokens_month: null };
}
