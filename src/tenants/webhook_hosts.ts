import type { Sql } from "postgres";
import { type AllowListCacheOptions, type AllowListSpec, createAllowListReader } from "./allow_list.ts";

/** A host as stored and compared: lower case, no trailing dot, an IPv6 literal in brackets. */
export function normaliseHost(host: string): string {
  return host.trim().toLowerCase().replace(/\.$/, "");
}

const NAME = /^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$/;
const IPV6 = /^\[[0-9a-f:.]+\]$/;

/** The `tenant allow-…` list this module reads. */
export const WEBHOOK_HOSTS: AllowListSpec = {
  table: "tenant_webhook_hosts",
  column: "host",
  normalise: normaliseHost,
  refuse: (h, raw) =>
    NAME.test(h) || IPV6.test(h) ? null : `Not a host name (or an IPv6 literal in brackets): ${JSON.stringify(raw)}`,
};

/**
 * Whether a tenant may send a webhook to `url`, from a per-tenant cache (a
 * change takes effect within `ttlMs`). Only the host counts, not the port.
 */
export function createWebhookHostPolicy(
  { sql }: { sql: Sql },
  options: AllowListCacheOptions = {},
): (tenant: string, url: string) => Promise<boolean> {
  const hostsOf = createAllowListReader(sql, WEBHOOK_HOSTS, options);
  return async (tenant, url) => {
    const hosts = await hostsOf(tenant);
    if (hosts === null) return true;
    const host = URL.parse(url)?.hostname;
    return host !== undefined && hosts.has(normaliseHost(host));
  };
}
