import type { Sql } from "postgres";
import { createHash, timingSafeEqual } from "node:crypto";
import { HttpError } from "../http/problem.ts";
import { hashSecret, parseApiKey, TENANT_NAME } from "./tenant_store.ts";
import { createTenantCache, type TenantCacheOptions } from "./tenant_cache.ts";
import type { TenantChangeFeed } from "./tenant_changes.ts";

/** Resolves the tenant of a request. */
export type Authenticate = (req: Request) => Promise<string>;

/** Options for {@linkcode createAuthenticator}. */
export interface AuthOptions {
  mode: "api-key" | "trusted-header";
  /** Required in trusted-header mode (GATEWAY_SECRET): the gateway proves itself with `X-Gateway-Secret`. */
  gatewaySecret?: string;
  /** How old a cached key row (or tenant) may be; a revocation takes effect within this time. */
  cacheTtlMs?: number;
  /**
   * The most bytes (estimated) of keys (or tenants) found that the cache holds: {@linkcode KEY_CACHE_BYTES} in
   * api-key mode, `TENANT_CACHE_BYTES` in trusted-header mode when unset.
   */
  cacheBytes?: number;
  /** The most bytes (estimated) of unknown ids (or tenants) it holds apart; `ABSENT_CACHE_BYTES` when unset. */
  absentCacheBytes?: number;
  /** The process's lifetime: its caches are read again in bulk while it lasts, with or without requests. */
  signal?: AbortSignal;
  /** The tenant change log: the keys in use are confirmed through it rather than read again (`tenant_cache.ts`). */
  changes?: TenantChangeFeed;
  now?: () => number;
}

/** Defaults of {@linkcode createAuthenticator}. */
export const AUTH_DEFAULTS = {
  /** How old a cached key row (or tenant) may be (`cacheTtlMs`): a revocation takes effect within this time. */
  cacheTtlMs: 10_000,
} as const;

/** An id's row as cached: its tenant, its secret's hash, and the one key already checked against that hash. */
type Known = { tenant: string; hash: Uint8Array; verified?: string };
/**
 * A known key's row beyond its id and its tenant's name: the hash's typed array, the verified key, the object
 * (measured: 556 bytes a cached key of a 10-character tenant, the entry's overhead included).
 */
const KNOWN_BYTES = 420;
/** The most bytes (estimated) of known keys cached in api-key mode by default: about 60,000 keys. */
export const KEY_CACHE_BYTES = 32 * 1024 * 1024;

const unauthorized = (detail: string) => new HttpError(401, detail, { "www-authenticate": 'Bearer realm="oncely"' });

/** The length of `Bearer onc_<12 hex>_<43 base64url>`, the header every client sends for a well-formed key. */
const BEARER = "Bearer ";
const KEY_LENGTH = 60;

/**
 * Whether two strings of equal length are equal, in time that depends on their length only: every character is
 * compared, with no early exit.
 */
function constantTimeEqual(a: string, b: string): boolean {
  if (a.length !== b.length) return false;
  let diff = 0;
  for (let i = 0; i < a.length; i++) diff |= a.charCodeAt(i) ^ b.charCodeAt(i);
  return diff === 0;
}

/**
 * Creates the request authenticator. In `api-key` mode it reads
 * `Authorization: Bearer onc_<id>_<secret>`, looks the id up (cached
 * briefly), and compares the secret's hash in constant time; the key that
 * passed is kept with the cached row, so the next request with the same key
 * costs one constant-time string comparison instead of a hash (a SHA-256 per
 * request cost the API a share of its CPU under load; see README, "Tenants
 * and API keys"). In `trusted-header` mode it
 * trusts `X-Tenant-Id`, which only an authenticating gateway in front of the
 * service may set.
 * @throws {HttpError} 401 on missing or bad credentials.
 */
export function createAuthenticator({ sql }: { sql: Sql }, options: AuthOptions): Authenticate {
  const bounds = {
    ttlMs: options.cacheTtlMs ?? AUTH_DEFAULTS.cacheTtlMs,
    maxBytes: options.cacheBytes,
    absentBytes: options.absentCacheBytes,
    signal: options.signal,
    changes: options.changes,
    now: options.now,
  };
  if (options.mode === "trusted-header") return trustedHeader(sql, options, bounds);
  // Known keys and unknown ids are cached apart: a flood of invented ids fills only its own, bounded part
  // (each miss costs one query, then none for the TTL), and can never evict a good key. The keys in use are
  // read again in bulk while they are used, so a revoked key stops working within the TTL however often it
  // is used (the verified key goes with the row it was checked against).
  const rows = createTenantCache<Known>({
    ...bounds,
    maxBytes: bounds.maxBytes ?? KEY_CACHE_BYTES,
    read: async (ids) => {
      const found = await sql<{ id: string; tenant: string; secret_sha256: Uint8Array }[]>`
        SELECT id, tenant, secret_sha256 FROM api_keys WHERE id = ANY(${ids}) AND revoked_at IS NULL`;
      return new Map(found.map((r) => [r.id, { tenant: r.tenant, hash: new Uint8Array(r.secret_sha256) }]));
    },
    weigh: (known) => KNOWN_BYTES + known.tenant.length,
    tenantOf: (_, known) => known.tenant,
    // An id's secret never changes: a key checked against the row before is checked against it still.
    merge: (before, after) => {
      const same = before.hash.length === after.hash.length && timingSafeEqual(before.hash, after.hash);
      if (before.verified !== undefined && same) after.verified = before.verified;
      return after;
    },
  });

  /** The tenant of `key` when it is, character for character, the key last verified for its id. */
  const verifiedTenant = (key: string, entry: Known | undefined): string | undefined =>
    entry?.verified !== undefined && constantTimeEqual(key, entry.verified) ? entry.tenant : undefined;

  return async (req) => {
    const header = req.headers.get("authorization");
    if (!header) throw unauthorized("Authorization: Bearer <API key> is required");
    // The usual spelling: `Bearer onc_<id>_<secret>`, the id at a fixed place. A key verified before is
    // answered here without its pattern or its hash; any other goes the whole way below.
    if (header.length === BEARER.length + KEY_LENGTH && header.startsWith(BEARER)) {
      const key = header.slice(BEARER.length);
      const tenant = verifiedTenant(key, rows.peek(key.slice(4, 16))?.value);
      if (tenant !== undefined) return tenant;
    }
    const presented = /^Bearer\s+(\S+)\s*$/i.exec(header)?.[1];
    const parsed = presented === undefined ? null : parseApiKey(presented);
    if (!parsed) throw unauthorized("The API key is malformed");
    const entry = await rows.get(parsed.id);
    const tenant = entry ? verifiedTenant(presented!, entry) : undefined;
    if (tenant !== undefined) return tenant;
    // Only the very key that passed the hash check below is ever answered above (compared in constant time):
    // a wrong secret for a known id always comes here, and fails the check.
    const hash = hashSecret(parsed.secret);
    // Compare even when the id is unknown, so timing does not reveal which ids exist.
    const expected = entry?.hash ?? new Uint8Array(hash.length);
    if (!timingSafeEqual(hash, expected) || !entry) throw unauthorized("The API key is not valid");
    entry.verified = presented!;
    return entry.tenant;
  };
}

const digest = (value: string) => createHash("sha256").update(value).digest();

/**
 * Trusted-header mode: the gateway in front authenticates clients and names
 * the tenant in `X-Tenant-Id`. The service believes it only from a caller
 * that sends the gateway's secret, and only for a tenant that exists and has
 * an active key (a revoked tenant is refused here too).
 */
function trustedHeader(
  sql: Sql,
  options: AuthOptions,
  bounds: Omit<TenantCacheOptions<true>, "read">,
): Authenticate {
  if (!options.gatewaySecret) throw new TypeError("trusted-header mode needs a gateway secret");
  const secret = digest(options.gatewaySecret);
  // Tenants with no active key are cached apart, as unknown ids are: a gateway's flood of names fills only that.
  const active = createTenantCache<true>({
    ...bounds,
    read: async (tenants) => {
      const rows = await sql<{ tenant: string }[]>`
        SELECT DISTINCT tenant FROM api_keys WHERE tenant = ANY(${tenants}) AND revoked_at IS NULL`;
      return new Map(rows.map((r) => [r.tenant, true]));
    },
  });
  const isActive = async (tenant: string) => {
    const hit = active.peek(tenant);
    return (hit ? hit.value : await active.get(tenant)) === true;
  };
  return async (req) => {
    // Hashing first gives both sides one length, so the comparison time reveals nothing about the secret.
    if (!timingSafeEqual(digest(req.headers.get("x-gateway-secret") ?? ""), secret)) {
      throw unauthorized("X-Gateway-Secret is missing or wrong: only the gateway may call this API");
    }
    const tenant = req.headers.get("x-tenant-id");
    if (!tenant) throw unauthorized("X-Tenant-Id header is required");
    if (!TENANT_NAME.test(tenant)) throw unauthorized("X-Tenant-Id is not a valid tenant name");
    if (!(await isActive(tenant))) throw unauthorized("The tenant does not exist or is revoked");
    return tenant;
  };
}
