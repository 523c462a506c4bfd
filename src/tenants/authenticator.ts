import type { Sql } from "postgres";
import { createHash, timingSafeEqual } from "node:crypto";
import { HttpError } from "../http/problem.ts";
import { hashSecret, parseApiKey, TENANT_NAME } from "./tenant_store.ts";

/** Resolves the tenant of a request. */
export type Authenticate = (req: Request) => Promise<string>;

/** Options for {@linkcode createAuthenticator}. */
export interface AuthOptions {
  mode: "api-key" | "trusted-header";
  /** Required in trusted-header mode (GATEWAY_SECRET): the gateway proves itself with `X-Gateway-Secret`. */
  gatewaySecret?: string;
  /** How long a key lookup is cached; a revocation takes effect within this time. */
  cacheTtlMs?: number;
  /** Most cached key ids kept at once. */
  cacheSize?: number;
  now?: () => number;
}

/** An id's row as cached: its tenant, its secret's hash, and the one key already checked against that hash. */
type Known = { tenant: string; hash: Uint8Array; verified?: string; expires: number };

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
  const ttl = options.cacheTtlMs ?? 10_000;
  const size = options.cacheSize ?? 10_000;
  const now = options.now ?? (() => performance.now());
  if (options.mode === "trusted-header") return trustedHeader(sql, options, { ttl, size, now });
  // Known keys and unknown ids are cached apart: a flood of invented ids fills only its own, bounded map
  // (each miss costs one query, then none for the TTL), and can never evict a good key.
  const known = new Map<string, Known>();
  const unknown = new Map<string, number>();
  const remember = <V>(map: Map<string, V>, id: string, value: V) => {
    if (map.size >= size) map.delete(map.keys().next().value!);
    map.set(id, value);
  };

  /**
   * The id's row, read again once its entry is `ttl` old: a revoked key stops working within `ttl`, however
   * often it is used (the verified key goes with the row it was checked against).
   */
  const lookup = async (id: string): Promise<Known | null> => {
    const hit = known.get(id);
    if (hit && hit.expires > now()) return hit;
    const miss = unknown.get(id);
    if (miss !== undefined && miss > now()) return null;
    const [row] = await sql<{ tenant: string; secret_sha256: Uint8Array }[]>`
      SELECT tenant, secret_sha256 FROM api_keys WHERE id = ${id} AND revoked_at IS NULL`;
    if (!row) {
      known.delete(id); // revoked since it was cached
      remember(unknown, id, now() + ttl);
      return null;
    }
    const entry: Known = { tenant: row.tenant, hash: new Uint8Array(row.secret_sha256), expires: now() + ttl };
    // An id's secret never changes: a key checked against the row before is checked against it still.
    if (hit?.verified !== undefined && timingSafeEqual(hit.hash, entry.hash)) entry.verified = hit.verified;
    unknown.delete(id);
    remember(known, id, entry);
    return entry;
  };

  /** The tenant of `key` when it is, character for character, the key last verified for its id. */
  const verifiedTenant = (key: string, entry: Known | undefined): string | undefined =>
    entry?.verified !== undefined && entry.expires > now() && constantTimeEqual(key, entry.verified)
      ? entry.tenant
      : undefined;

  return async (req) => {
    const header = req.headers.get("authorization");
    if (!header) throw unauthorized("Authorization: Bearer <API key> is required");
    // The usual spelling: `Bearer onc_<id>_<secret>`, the id at a fixed place. A key verified before is
    // answered here without its pattern or its hash; any other goes the whole way below.
    if (header.length === BEARER.length + KEY_LENGTH && header.startsWith(BEARER)) {
      const key = header.slice(BEARER.length);
      const tenant = verifiedTenant(key, known.get(key.slice(4, 16)));
      if (tenant !== undefined) return tenant;
    }
    const presented = /^Bearer\s+(\S+)\s*$/i.exec(header)?.[1];
    const parsed = presented === undefined ? null : parseApiKey(presented);
    if (!parsed) throw unauthorized("The API key is malformed");
    const entry = await lookup(parsed.id);
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
  { ttl, size, now }: { ttl: number; size: number; now: () => number },
): Authenticate {
  if (!options.gatewaySecret) throw new TypeError("trusted-header mode needs a gateway secret");
  const secret = digest(options.gatewaySecret);
  const active = new Map<string, { ok: boolean; expires: number }>();
  const isActive = async (tenant: string) => {
    const hit = active.get(tenant);
    if (hit && hit.expires > now()) return hit.ok;
    const [row] = await sql<{ ok: boolean }[]>`
      SELECT EXISTS (SELECT 1 FROM api_keys WHERE tenant = ${tenant} AND revoked_at IS NULL) AS ok`;
    if (active.size >= size) active.delete(active.keys().next().value!);
    active.set(tenant, { ok: row!.ok, expires: now() + ttl });
    return row!.ok;
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
