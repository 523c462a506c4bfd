import type { Sql } from "postgres";
import { createApiKey, listTenants, revokeTenant, tenantExists } from "../tenants/tenant_store.ts";
import { printRows } from "./table.ts";
import { ALLOW_LIST_CACHE_MS, type AllowListSpec, allowValue } from "../tenants/allow_list.ts";
import { MAIL_DOMAINS } from "../tenants/mail_domains.ts";
import { WEBHOOK_HOSTS } from "../tenants/webhook_hosts.ts";
import { ensureWebhookSecret, rotateWebhookSecret } from "../tenants/webhook_secrets.ts";
import { parseTenantWeight, setTenantWeight, TENANT_WEIGHTS_TTL_MS } from "../tenants/tenant_weights.ts";
import type { RedisClient } from "../clients.ts";
import { KEY_PREFIX, serviceKeys } from "../runs/keys.ts";
import { loadTenantBudgets, parseBudgetArgs, setTenantBudget } from "../tenants/tenant_budgets.ts";
import { chargedThisPeriod } from "../jobs/job_store.ts";
import { type BudgetRecords, currentViews, hasBudget, seedFromRecord, type TenantBudget } from "../budgets/budgets.ts";
import type { BudgetView } from "../budgets/budget_view.ts";

const USAGE = "Usage: deno task tenant create NAME | list [--json] | revoke NAME | rotate-webhook-secret NAME" +
  " | allow-domain NAME DOMAIN | allow-domain NAME --any | allow-webhook-host NAME HOST" +
  " | allow-webhook-host NAME --any | set NAME --weight N" +
  " | budget NAME [--usd-per-day X] [--usd-per-month X] [--tokens-per-day N] [--tokens-per-month N] | budget NAME --none";

/** Runs `command`; a bad argument (a `TypeError` from validation) is printed and exits 2. */
async function usageErrorsAs2(command: () => Promise<number>): Promise<number> {
  try {
    return await command();
  } catch (error) {
    if (!(error instanceof TypeError)) throw error;
    console.error(error.message);
    return 2;
  }
}

/**
 * `tenant create NAME | list | revoke NAME | rotate-webhook-secret NAME |
 * allow-domain | allow-webhook-host | set NAME --weight N`. `create` prints the new key as the
 * last line on stdout, and before it, for a new tenant, its webhook signing
 * secret.
 * @returns the process exit code.
 */
export async function tenantCommand(
  sql: Sql,
  args: string[],
  out = console.log,
  { redis, prefix = KEY_PREFIX, records }: {
    redis?: RedisClient;
    prefix?: string;
    /** What a budget hash seeded here is rebuilt from: the processes' records (with batch lines' holds). */
    records?: Pick<BudgetRecords, "spent">;
  } = {},
): Promise<number> {
  const [action, name] = args;
  const run = action === "list"
    ? list
    : action === "budget" && name
    ? budget
    : name && action !== undefined && Object.hasOwn(ACTIONS, action)
    ? ACTIONS[action as keyof typeof ACTIONS]
    : undefined;
  const code = run ? await run(sql, name ?? "", args, out, { redis, prefix, records }) : undefined;
  if (code !== undefined) return code;
  console.error(USAGE);
  return 2;
}

/** Where budgets' spend lives (Redis), for `budget` and `list`. */
interface Spend {
  redis?: RedisClient;
  prefix: string;
  records?: Pick<BudgetRecords, "spent">;
}

/** One action: its exit code, or undefined for a usage error. */
type Action = (
  sql: Sql,
  name: string,
  args: string[],
  out: (line: string) => void,
  spend?: Spend,
) => Promise<number | undefined>;

const withinCache = `within ${ALLOW_LIST_CACHE_MS / 1000} seconds`;

const ACTIONS = {
  create: (sql, name, _args, out) =>
    usageErrorsAs2(async () => {
      const key = await createApiKey(sql, name);
      const secret = await ensureWebhookSecret(sql, name);
      if (secret) {
        out(`Webhook signing secret of tenant "${name}" (receivers verify webhooks with it; shown once):`);
        out(secret);
      }
      out(`Created an API key for tenant "${name}". Store it now; it cannot be shown again.`);
      out(key);
      return 0;
    }),
  "allow-domain": allowAction(
    MAIL_DOMAINS,
    (name, domains) =>
      domains.length
        ? `Tenant "${name}" may email only: ${domains.join(", ")} (${withinCache}).`
        : `Tenant "${name}" may email any domain (${withinCache}).`,
  ),
  "allow-webhook-host": allowAction(
    WEBHOOK_HOSTS,
    (name, hosts) =>
      hosts.length
        ? `Tenant "${name}" may send webhooks only to: ${hosts.join(", ")} (${withinCache}).`
        : `Tenant "${name}" may send webhooks to any host (${withinCache}).`,
  ),
  set: setWeight,
  "rotate-webhook-secret": existing(async (sql, name, _args, out) => {
    const secret = await rotateWebhookSecret(sql, name);
    out(
      `New webhook signing secret of tenant "${name}" (shown once). For 24 hours webhooks carry signatures ` +
        `by both the old and the new secret, so receivers can switch without missing a delivery:`,
    );
    out(secret);
    return 0;
  }),
  revoke: existing(async (sql, name, _args, out) => {
    const n = await revokeTenant(sql, name);
    out(`Revoked ${n} key(s) of tenant "${name}". Cached keys stop working within 10 seconds.`);
    return 0;
  }),
} satisfies Record<string, Action>;

async function list(sql: Sql, _name: string, args: string[], out: (line: string) => void, spend?: Spend) {
  const rows = await listTenants(sql);
  const budgets = await loadTenantBudgets(sql);
  const shown = await Promise.all(rows.map(async (r) => {
    const budget = budgets.get(r.name);
    return {
      name: r.name,
      weight: r.weight,
      active_keys: r.active_keys,
      revoked_keys: r.revoked_keys,
      budget: budget && hasBudget(budget) ? describeBudgets(await budgetViews(budget, r.name, spend)) : "-",
      created_at: r.created_at.toISOString(),
    };
  }));
  printRows(
    shown,
    { json: args.includes("--json"), out, empty: "No tenants yet. Create one with: deno task tenant create NAME" },
  );
  return 0;
}

/** The action only for a tenant that exists: exit 1 naming it otherwise. */
function existing(action: Action): Action {
  return async (sql, name, args, out) => {
    if (!(await tenantExists(sql, name))) {
      console.error(`No tenant named ${JSON.stringify(name)}`);
      return 1;
    }
    return await action(sql, name, args, out);
  };
}

/** `allow-… NAME VALUE` adds to a tenant's allow list; `allow-… NAME --any` empties it. */
function allowAction(
  list: AllowListSpec,
  say: (name: string, values: string[]) => string,
): Action {
  return async (sql, name, args, out) => {
    const value = args[2];
    if (!value) return undefined;
    return await existing((sql, name) =>
      usageErrorsAs2(async () => {
        out(say(name, await allowValue(sql, list, name, value === "--any" ? null : value)));
        return 0;
      })
    )(sql, name, args, out);
  };
}

/** `set NAME --weight N` (or `--weight=N`): one setting for now. */
async function setWeight(sql: Sql, name: string, args: string[], out: (line: string) => void) {
  const rest = args.slice(2);
  const value = rest.length === 2 && rest[0] === "--weight"
    ? rest[1]
    : rest.length === 1 && rest[0]!.startsWith("--weight=")
    ? rest[0]!.slice("--weight=".length)
    : undefined;
  if (value === undefined) return undefined;
  let weight: number;
  try {
    weight = parseTenantWeight(value);
  } catch (error) {
    if (!(error instanceof TypeError)) throw error;
    console.error(error.message);
    console.error(USAGE);
    return 2;
  }
  if (!(await setTenantWeight(sql, name, weight))) {
    console.error(`No tenant named ${JSON.stringify(name)}`);
    return 1;
  }
  out(
    `Tenant "${name}" has weight ${weight} in the fair share of the model provider ` +
      `(workers use it within ${TENANT_WEIGHTS_TTL_MS / 1000} seconds).`,
  );
  return 0;
}

/** A tenant's budgets with what is spent (and reserved), when Redis is at hand; the limits alone otherwise. */
function budgetViews(budget: TenantBudget, tenant: string, spend?: Spend): Promise<BudgetView[]> {
  return currentViews({ redis: spend?.redis, keys: serviceKeys(spend?.prefix ?? KEY_PREFIX) }, tenant, budget);
}

/** `usd/day 4.2/10 (reserved 0.3), tokens/month 120000/1000000`. */
function describeBudgets(views: BudgetView[]): string {
  const n = (unit: string, x: number) => unit === "usd" ? String(Math.round(x * 1e6) / 1e6) : String(x);
  return views.map((v) =>
    `${v.unit}/${v.period} ${n(v.unit, v.spent)}/${n(v.unit, v.limit)}` +
    (v.reserved > 0 ? ` (reserved ${n(v.unit, v.reserved)})` : "")
  ).join(", ");
}

/**
 * `budget NAME [--usd-per-day X] ...` sets (or with `none`, clears) limits; `budget NAME --none` clears every
 * one; `budget NAME` alone shows them. A new limit counts what the tenant spent earlier in the period (from
 * `model_attempts`). Workers and the API use the change within a few seconds.
 */
async function budget(sql: Sql, name: string, args: string[], out: (line: string) => void, spend?: Spend) {
  let change;
  try {
    change = parseBudgetArgs(args.slice(2));
  } catch (error) {
    if (!(error instanceof TypeError)) throw error;
    console.error(error.message);
    console.error(USAGE);
    return 2;
  }
  const after = await setTenantBudget(sql, name, change);
  if (after === null) {
    console.error(`No tenant named ${JSON.stringify(name)}`);
    return 1;
  }
  if (spend?.redis && hasBudget(after)) {
    // The processes' records (with the tenant's batch lines in flight, held in a hash seeded here), else the spend.
    const records = spend.records ?? { spent: (tenant: string) => chargedThisPeriod(sql, tenant) };
    await seedFromRecord({ redis: spend.redis, keys: serviceKeys(spend.prefix), records }, name);
  }
  if (!hasBudget(after)) {
    out(`Tenant "${name}" has no budget: its spending is not limited.`);
    return 0;
  }
  const changed = Object.keys(change).length > 0 ? " (in force within a few seconds)" : "";
  out(`Tenant "${name}" budgets${changed}: ${describeBudgets(await budgetViews(after, name, spend))}`);
  return 0;
}
