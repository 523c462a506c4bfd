import type { Sql } from "postgres";
import { timingSafeEqual } from "node:crypto";
import { HttpError } from "../http/problem.ts";
import { hashSecret, parseApiKey, TENANT_NAME } from "./tenant_store.ts";

/** Resolves the tenant of a request. */
export type Authenticate = (req: Request) => Promise<string>;

/** Options for {@linkcode createAuthenticator}. */
export interface AuthOptions {
  mode: "api-key" | "trusted-header";
  /** How long a key lookup is cached; a revocation takes effect within this time. */
  cacheTtlMs?: number;
  /** Most cached key ids kept at once. */
  cacheSize?: number;
  now?: () => number;
}

type Cached = { tenant: string; hash: Uint8Array } | null;

const unauthorized = (detail: string) => new HttpError(401, detail, { "www-authenticate": 'Bearer realm="oncely"' });

/**
 * Creates the request authenticator. In `api-key` mode it reads
 * `Authorization: Bearer onc_<id>_<secret>`, looks the id up (cached
 * briefly), and compares the secret's hash in constant time. In
 * `trusted-header` mode it trusts `X-Tenant-Id`, which only an
 * authenticating gateway in front of the service may set.
 * @throws {HttpError} 401 on missing or bad credentials.
 */
export function createAuthenticator({ sql }: { sql: Sql }, options: AuthOptions): Authenticate {
  if (options.mode === "trusted-header") {
    return (req) => {
      const tenant = req.headers.get("x-tenant-id");
      if (!tenant) return Promise.reject(unauthorized("X-Tenant-Id header is required"));
      if (!TENANT_NAME.test(tenant)) return Promise.reject(unauthorized("X-Tenant-Id is not a valid tenant name"));
      return Promise.resolve(tenant);
    };
  }
  const ttl = options.cacheTtlMs ?? 10_000;
  const size = options.cacheSize ?? 10_000;
  const now = options.now ?? (() => performance.now());
  const cache = new Map<string, { value: Cached; expires: number }>();

  const lookup = async (id: string): Promise<Cached> => {
    const hit = cache.get(id);
    if (hit && hit.expires > now()) return hit.value;
    const [row] = await sql<{ tenant: string; secret_sha256: Uint8Array }[]>`
      SELECT tenant, secret_sha256 FROM api_keys WHERE id = ${id} AND revoked_at IS NULL`;
    const value = row ? { tenant: row.tenant, hash: new Uint8Array(row.secret_sha256) } : null;
    if (cache.size >= size) cache.delete(cache.keys().next().value!);
    cache.set(id, { value, expires: now() + ttl });
    return value;
  };

  return async (req) => {
    const header = req.headers.get("authorization");
    if (!header) throw unauthorized("Authorization: Bearer <API key> is required");
    const match = /^Bearer\s+(\S+)\s*$/i.exec(header);
    const parsed = match ? parseApiKey(match[1]!) : null;
    if (!parsed) throw unauthorized("The API key is malformed");
    const entry = await lookup(parsed.id);
    const hash = hashSecret(parsed.secret);
    // Compare even when the id is unknown, so timing does not reveal which ids exist.
    const expected = entry?.hash ?? new Uint8Array(hash.length);
    if (!timingSafeEqual(hash, expected) || !entry) throw unauthorized("The API key is not valid");
    return entry.tenant;
  };
}
