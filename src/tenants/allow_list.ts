/**
 * A tenant's allow list: the rows `(tenant, value)` of one table. A tenant
 * with no rows may use any value; with rows, only those. Mail domains and
 * webhook hosts are two such lists.
 */
import type { Sql } from "postgres";

/** How one list is stored and what it accepts. */
export interface AllowListSpec {
  table: "tenant_mail_domains" | "tenant_webhook_hosts";
  column: "domain" | "host";
  /** A value as stored and compared. */
  normalise(value: string): string;
  /** The error for a normalised value the list does not accept, or null when it is fine. */
  refuse(normalised: string, raw: string): string | null;
}

/** How long a tenant's list is cached by a policy; a change takes effect within it. */
export const ALLOW_LIST_CACHE_MS = 10_000;
/** Tenants whose lists a policy caches at once. */
const CACHE_TENANTS = 10_000;

/**
 * Adds `value` to the tenant's list, or with `value` null empties it (the
 * tenant may use any value again).
 * @returns the list as it is now.
 * @throws {TypeError} for a value the list does not accept.
 */
export async function allowValue(sql: Sql, spec: AllowListSpec, tenant: string, value: string | null) {
  const table = sql(spec.table);
  const column = sql(spec.column);
  if (value === null) {
    await sql`DELETE FROM ${table} WHERE tenant = ${tenant}`;
    return [];
  }
  const v = spec.normalise(value);
  const refused = spec.refuse(v, value);
  if (refused) throw new TypeError(refused);
  await sql`INSERT INTO ${table} (tenant, ${column}) VALUES (${tenant}, ${v}) ON CONFLICT DO NOTHING`;
  const rows = await sql<{ value: string }[]>`
    SELECT ${column} AS value FROM ${table} WHERE tenant = ${tenant} ORDER BY ${column}`;
  return rows.map((r) => r.value);
}

/**
 * A cached reader of tenants' lists: resolves to the tenant's allowed values,
 * or null when it may use any.
 */
export function createAllowListReader(
  sql: Sql,
  spec: AllowListSpec,
  { ttlMs = ALLOW_LIST_CACHE_MS, now = () => performance.now() }: { ttlMs?: number; now?: () => number } = {},
): (tenant: string) => Promise<Set<string> | null> {
  const cache = new Map<string, { values: Set<string> | null; expires: number }>();
  return async (tenant) => {
    let entry = cache.get(tenant);
    if (!entry || entry.expires <= now()) {
      const rows = await sql<{ value: string }[]>`
        SELECT ${sql(spec.column)} AS value FROM ${sql(spec.table)} WHERE tenant = ${tenant}`;
      entry = { values: rows.length ? new Set(rows.map((r) => r.value)) : null, expires: now() + ttlMs };
      if (cache.size >= CACHE_TENANTS) cache.delete(cache.keys().next().value!);
      cache.set(tenant, entry);
    }
    return entry.values;
  };
}
