/**
 * Each tenant's Standard Webhooks signing secret (`whsec_` + base64). It is
 * shown once, when made, and stored in Postgres because the relay must sign
 * with it (an HMAC needs the secret itself, unlike an API key's hash). After a
 * rotation the previous secret keeps signing beside the new one for a day, so
 * a receiver can move to the new secret without rejecting a delivery.
 */
import type { Sql } from "postgres";
import { newWebhookSecret } from "../webhooks/signature.ts";
import { createTenantCache } from "./tenant_cache.ts";
import type { TenantChangeFeed } from "./tenant_changes.ts";

/** How long a rotated-out secret still signs. */
export const PREVIOUS_SECRET_GRACE_S = 24 * 3600;
const CACHE_MS = 10_000;

/** Gives the tenant a secret if it has none. @returns the new secret, or null if it already had one. */
export async function ensureWebhookSecret(sql: Sql, tenant: string): Promise<string | null> {
  const secret = newWebhookSecret();
  const rows = await sql`
    UPDATE tenants SET webhook_secret = ${secret} WHERE name = ${tenant} AND webhook_secret IS NULL RETURNING name`;
  return rows.length > 0 ? secret : null;
}

/** A new secret for the tenant; the old one keeps signing for {@linkcode PREVIOUS_SECRET_GRACE_S}. */
export async function rotateWebhookSecret(sql: Sql, tenant: string): Promise<string> {
  const secret = newWebhookSecret();
  const rows = await sql`
    UPDATE tenants SET webhook_secret_previous = webhook_secret, webhook_secret = ${secret},
      webhook_secret_rotated_at = now()
    WHERE name = ${tenant} RETURNING name`;
  if (rows.length === 0) throw new TypeError(`No tenant named ${JSON.stringify(tenant)}`);
  return secret;
}

/** The secrets each tenant signs with now: its current one, and its previous one within the grace. */
export async function signingSecrets(sql: Sql, tenants: string[]): Promise<Map<string, string[]>> {
  const rows = await sql<{ name: string; current: string | null; previous: string | null }[]>`
    SELECT name, webhook_secret AS current,
      CASE WHEN webhook_secret_rotated_at > now() - ${PREVIOUS_SECRET_GRACE_S} * interval '1 second'
        THEN webhook_secret_previous END AS previous
    FROM tenants WHERE name = ANY(${tenants})`;
  return new Map(
    rows.filter((r) => r.current).map((r) => [r.name, [r.current!, ...(r.previous ? [r.previous] : [])]]),
  );
}

/**
 * Whether a tenant has a secret, cached per tenant for 10 s once it has one
 * (the API asks on every webhook POST), and read again in bulk while in use
 * (`tenant_cache.ts`, which states the bound; a timer reads them too while
 * `signal` lasts). "No secret" is not cached, so a webhook POST works as soon
 * as `rotate-webhook-secret` has run.
 */
export function createSecretCheck(
  sql: Sql,
  { signal, changes }: { signal?: AbortSignal; changes?: TenantChangeFeed } = {},
): (tenant: string) => Promise<boolean> {
  const secrets = createTenantCache<true>({
    ttlMs: CACHE_MS,
    signal,
    changes,
    absentBytes: 0,
    read: async (tenants) => {
      const rows = await sql<{ name: string }[]>`
        SELECT name FROM tenants WHERE name = ANY(${tenants}) AND webhook_secret IS NOT NULL`;
      return new Map(rows.map((r) => [r.name, true]));
    },
  });
  return async (tenant) => {
    const hit = secrets.peek(tenant);
    return (hit ? hit.value : await secrets.get(tenant)) === true;
  };
}
