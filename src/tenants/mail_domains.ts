import type { Sql } from "postgres";
import { type AllowListCacheOptions, type AllowListSpec, createAllowListReader } from "./allow_list.ts";

/** An email domain as stored and compared: lower case, no trailing dot. */
export function normaliseDomain(domain: string): string {
  return domain.trim().toLowerCase().replace(/\.$/, "");
}

const DOMAIN = /^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}$/;

/** The `tenant allow-…` list this module reads. */
export const MAIL_DOMAINS: AllowListSpec = {
  table: "tenant_mail_domains",
  column: "domain",
  normalise: normaliseDomain,
  refuse: (d, raw) => DOMAIN.test(d) ? null : `Not a domain name: ${JSON.stringify(raw)}`,
};

/**
 * Whether a tenant may email `address`, from a per-tenant cache (a change
 * takes effect within `ttlMs`).
 */
export function createRecipientPolicy(
  { sql }: { sql: Sql },
  options: AllowListCacheOptions = {},
): (tenant: string, address: string) => Promise<boolean> {
  const domainsOf = createAllowListReader(sql, MAIL_DOMAINS, options);
  return async (tenant, address) => {
    const domains = await domainsOf(tenant);
    return domains === null || domains.has(normaliseDomain(address.slice(address.lastIndexOf("@") + 1)));
  };
}
