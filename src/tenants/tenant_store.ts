import type { Sql } from "postgres";
import { sha256, toHex } from "../crypto/digest.ts";

/** Tenant names: short, printable, and safe in logs and metrics labels. */
export const TENANT_NAME = /^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$/;

const KEY_PATTERN = /^onc_([0-9a-f]{12})_([A-Za-z0-9_-]{43})$/;
const UNIQUE_VIOLATION = "23505";

/** A tenant as `tenant list` shows it. */
export interface TenantRow {
  name: string;
  created_at: Date;
  /** Its share of the model provider while several tenants have work (`tenant set NAME --weight N`). */
  weight: number;
  active_keys: number;
  revoked_keys: number;
}

/** @throws {TypeError} if the name is not a valid tenant name. */
export function assertTenantName(name: string): void {
  if (!TENANT_NAME.test(name)) {
    throw new TypeError(
      `Tenant name must be 1-64 letters, digits, "_", "." or "-", starting with a letter or digit (got ${
        JSON.stringify(name)
      })`,
    );
  }
}

function base64url(bytes: Uint8Array): string {
  return btoa(String.fromCharCode(...bytes)).replaceAll("+", "-").replaceAll("/", "_").replace(/=+$/, "");
}

/** Splits an API key into its public id and secret, or null if it is not shaped like one. */
export function parseApiKey(key: string): { id: string; secret: string } | null {
  const match = KEY_PATTERN.exec(key);
  return match ? { id: match[1]!, secret: match[2]! } : null;
}

/** Hash of a key's secret, as stored. */
export function hashSecret(secret: string): Uint8Array {
  return sha256(secret);
}

/**
 * Creates the tenant if needed and a new API key for it. Only the secret's
 * SHA-256 is stored; the key itself is returned once and never again.
 */
export async function createApiKey(sql: Sql, tenant: string): Promise<string> {
  assertTenantName(tenant);
  for (;;) {
    const id = toHex(crypto.getRandomValues(new Uint8Array(6)));
    const secret = base64url(crypto.getRandomValues(new Uint8Array(32)));
    const hash = sha256(secret);
    try {
      await sql.begin(async (tx) => {
        await tx`INSERT INTO tenants (name) VALUES (${tenant}) ON CONFLICT (name) DO NOTHING`;
        await tx`INSERT INTO api_keys (id, tenant, secret_sha256) VALUES (${id}, ${tenant}, ${hash})`;
      });
      return `onc_${id}_${secret}`;
    } catch (error) {
      // A 48-bit id collision is astronomically rare, but cheap to survive.
      if ((error as { code?: string }).code !== UNIQUE_VIOLATION) throw error;
    }
  }
}

/** Lists tenants with their weights and key counts. */
export async function listTenants(sql: Sql): Promise<TenantRow[]> {
  return await sql<TenantRow[]>`
    SELECT t.name, t.created_at, t.weight,
      count(k.id) FILTER (WHERE k.revoked_at IS NULL)::int AS active_keys,
      count(k.id) FILTER (WHERE k.revoked_at IS NOT NULL)::int AS revoked_keys
    FROM tenants t LEFT JOIN api_keys k ON k.tenant = t.name
    GROUP BY t.name, t.created_at, t.weight ORDER BY t.name`;
}

/** Revokes every active key of a tenant. @returns how many keys were revoked. */
export async function revokeTenant(sql: Sql, tenant: string): Promise<number> {
  const rows = await sql`
    UPDATE api_keys SET revoked_at = now() WHERE tenant = ${tenant} AND revoked_at IS NULL RETURNING id`;
  return rows.length;
}

/** Whether the tenant exists. */
export async function tenantExists(sql: Sql, tenant: string): Promise<boolean> {
  const rows = await sql`SELECT 1 FROM tenants WHERE name = ${tenant}`;
  return rows.length > 0;
}
