/**
 * A tenant's allow list: the rows `(tenant, value)` of one table. A tenant
 * with no rows may use any value; with rows, only those. Mail domains and
 * webhook hosts are two such lists.
 */
import type { Sql } from "postgres";
import { createTenantCache } from "./tenant_cache.ts";
import type { TenantChangeFeed } from "./tenant_changes.ts";

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

/** How a policy caches the lists. */
export interface AllowListCacheOptions {
  /** How old a cached list may be: a change takes effect within it. {@linkcode ALLOW_LIST_CACHE_MS} when unset. */
  ttlMs?: number;
  /** The process's lifetime: the lists in use are read again in bulk while it lasts (`tenant_cache.ts`). */
  signal?: AbortSignal;
  /** The tenant change log: the lists in use are confirmed through it rather than read again (`tenant_cache.ts`). */
  changes?: TenantChangeFeed;
  now?: () => number;
}

/**
 * A cached reader of tenants' lists: resolves to the tenant's allowed values,
 * or null when it may use any. The lists of the tenants in use are read again
 * in bulk within `ttlMs` (`tenant_cache.ts`, which states the bound).
 */
export function createAllowListReader(
  sql: Sql,
  spec: AllowListSpec,
  { ttlMs = ALLOW_LIST_CACHE_MS, now, signal, changes }: AllowListCacheOptions = {},
): (tenant: string) => Promise<Set<string> | null> {
  const lists = createTenantCache<Set<string> | null>({
    ttlMs,
    now,
    signal,
    changes,
    // Every tenant asked about is answered: most have no list (null), and are read again with the others.
    read: async (tenants) => {
      const rows = await sql<{ tenant: string; value: string }[]>`
        SELECT tenant, ${sql(spec.column)} AS value FROM ${sql(spec.table)} WHERE tenant = ANY(${tenants})`;
      const found = new Map<string, Set<string> | null>(tenants.map((tenant) => [tenant, null]));
      for (const { tenant, value } of rows) {
        const values = found.get(tenant);
        if (values) values.add(value);
        else found.set(tenant, new Set([value]));
      }
      return found;
    },
    weigh: (values) => {
      let bytes = 0;
      for (const value of values ?? []) bytes += 64 + 2 * value.length;
      return bytes;
    },
  });
  return async (tenant) => {
    const hit = lists.peek(tenant);
    return (hit ? hit.value : await lists.get(tenant)) ?? null;
  };
}
