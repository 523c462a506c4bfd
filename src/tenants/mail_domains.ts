import type { Sql } from "postgres";

/** An email domain as stored and compared: lower case, no trailing dot. */
export function normaliseDomain(domain: string): string {
  return domain.trim().toLowerCase().replace(/\.$/, "");
}

const DOMAIN = /^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}$/;

/**
 * Restricts a tenant's recipients to `domain` (adding to its list), or with
 * `domain` null frees it to mail any domain.
 * @throws {TypeError} for a string that is not a domain name.
 */
export async function allowDomain(sql: Sql, tenant: string, domain: string | null): Promise<string[]> {
  if (domain === null) {
    await sql`DELETE FROM tenant_mail_domains WHERE tenant = ${tenant}`;
    return [];
  }
  const d = normaliseDomain(domain);
  if (!DOMAIN.test(d)) throw new TypeError(`Not a domain name: ${JSON.stringify(domain)}`);
  await sql`INSERT INTO tenant_mail_domains (tenant, domain) VALUES (${tenant}, ${d}) ON CONFLICT DO NOTHING`;
  const rows = await sql<{ domain: string }[]>`
    SELECT domain FROM tenant_mail_domains WHERE tenant = ${tenant} ORDER BY domain`;
  return rows.map((r) => r.domain);
}

/**
 * Whether a tenant may email `address`, from a per-tenant cache (a change
 * takes effect within `ttlMs`).
 */
export function createRecipientPolicy(
  { sql }: { sql: Sql },
  { ttlMs = 10_000, now = () => performance.now() }: { ttlMs?: number; now?: () => number } = {},
): (tenant: string, address: string) => Promise<boolean> {
  const cache = new Map<string, { domains: Set<string> | null; expires: number }>();
  return async (tenant, address) => {
    let entry = cache.get(tenant);
    if (!entry || entry.expires <= now()) {
      const rows = await sql<{ domain: string }[]>`SELECT domain FROM tenant_mail_domains WHERE tenant = ${tenant}`;
      entry = { domains: rows.length ? new Set(rows.map((r) => r.domain)) : null, expires: now() + ttlMs };
      if (cache.size >= 10_000) cache.delete(cache.keys().next().value!);
      cache.set(tenant, entry);
    }
    if (entry.domains === null) return true;
    return entry.domains.has(normaliseDomain(address.slice(address.lastIndexOf("@") + 1)));
  };
}
