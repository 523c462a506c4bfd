import type { Sql } from "postgres";

/** A host as stored and compared: lower case, no trailing dot, an IPv6 literal in brackets. */
export function normaliseHost(host: string): string {
  return host.trim().toLowerCase().replace(/\.$/, "");
}

const NAME = /^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$/;
const IPV6 = /^\[[0-9a-f:.]+\]$/;

/**
 * Restricts a tenant's webhooks to `host` (adding to its list), or with
 * `host` null frees it to send to any host.
 * @throws {TypeError} for a string that is not a host name or an IP literal.
 */
export async function allowWebhookHost(sql: Sql, tenant: string, host: string | null): Promise<string[]> {
  if (host === null) {
    await sql`DELETE FROM tenant_webhook_hosts WHERE tenant = ${tenant}`;
    return [];
  }
  const h = normaliseHost(host);
  if (!NAME.test(h) && !IPV6.test(h)) {
    throw new TypeError(`Not a host name (or an IPv6 literal in brackets): ${JSON.stringify(host)}`);
  }
  await sql`INSERT INTO tenant_webhook_hosts (tenant, host) VALUES (${tenant}, ${h}) ON CONFLICT DO NOTHING`;
  const rows = await sql<
    { host: string }[]
  >`SELECT host FROM tenant_webhook_hosts WHERE tenant = ${tenant} ORDER BY host`;
  return rows.map((r) => r.host);
}

/**
 * Whether a tenant may send a webhook to `url`, from a per-tenant cache (a
 * change takes effect within `ttlMs`). Only the host counts, not the port.
 */
export function createWebhookHostPolicy(
  { sql }: { sql: Sql },
  { ttlMs = 10_000, now = () => performance.now() }: { ttlMs?: number; now?: () => number } = {},
): (tenant: string, url: string) => Promise<boolean> {
  const cache = new Map<string, { hosts: Set<string> | null; expires: number }>();
  return async (tenant, url) => {
    let entry = cache.get(tenant);
    if (!entry || entry.expires <= now()) {
      const rows = await sql<{ host: string }[]>`SELECT host FROM tenant_webhook_hosts WHERE tenant = ${tenant}`;
      entry = { hosts: rows.length ? new Set(rows.map((r) => r.host)) : null, expires: now() + ttlMs };
      if (cache.size >= 10_000) cache.delete(cache.keys().next().value!);
      cache.set(tenant, entry);
    }
    if (entry.hosts === null) return true;
    const host = URL.parse(url)?.hostname;
    return host !== undefined && entry.hosts.has(normaliseHost(host));
  };
}
