/**
 * Who may use the console: the check of ADMIN_TOKEN (one check, whether the
 * token comes in a `Bearer` header or the sign-in form) and the sessions a
 * sign-in starts. Both live in Redis, so every API process shares them: the
 * pace of checks, and whether a session still exists.
 */
import type { RedisClient } from "../clients.ts";
import type { Logger } from "../log/logger.ts";
import { TAKE_TURN_SCRIPT } from "./take_turn_script.ts";
import { deleteIfEqual } from "../redis/delete_if_equal_script.ts";

/** The check's pace and the sessions' lifetime. */
export interface AdminAuthOptions {
  /**
   * Each check of the token takes a turn this long, in order, across all API
   * processes: N guesses take N turns however many are sent at once. A right
   * token gives its turn back when nobody waits behind it.
   */
  turnMs: number;
  /** A check whose turn is further away than this is refused at once (429), without comparing the token. */
  maxWaitMs: number;
  /** How long a sign-in lasts. */
  sessionTtlS: number;
}

/** The defaults: 4 checks a second, at most 10 s of queue, 12-hour sessions. */
export const ADMIN_AUTH_DEFAULTS: AdminAuthOptions = { turnMs: 250, maxWaitMs: 10_000, sessionTtlS: 12 * 3600 };

/** Where a check came from, for the log line of a failed one. */
export interface AttemptSource {
  via: "bearer" | "form";
  /** The peer's address (a proxy's, behind one). */
  address?: string;
  /** The `X-Forwarded-For` header, as the client (or its proxy) sent it. */
  forwardedFor?: string | null;
}

/** The outcome of a check: let in, a wrong token, or refused unchecked for `retryAfterS`. */
export type Verdict = { ok: true } | { ok: false; retryAfterS?: number };

/** The console's access control. */
export interface AdminAuth {
  /** Checks a presented token in its turn; logs every failure (never the token). */
  check(candidate: string, source: AttemptSource): Promise<Verdict>;
  /** Starts a session: @returns the cookie value, `<id>.<HMAC of the id>`. */
  startSession(): Promise<string>;
  /** The cookie value if it names a live session (signed by this token, not expired, not signed out), else null. */
  session(cookieValue: string): Promise<string | null>;
  /** Ends the session a cookie value names; its cookie is then refused everywhere. */
  endSession(cookieValue: string): Promise<void>;
  /** An HMAC under the token, base64url, for values bound to a session (CSRF tokens). */
  mac(what: string): Promise<string>;
}

/** The console's Redis keys: its own hash tag, so each script's key is in one Cluster slot. */
export function consoleKeys(prefix: string) {
  return {
    /** The Redis time (ms) at which the next token check may run. */
    nextTurn: `${prefix}:{console}:next_turn`,
    /** A live session, by the SHA-256 of its id (Redis never holds a usable cookie). */
    session: (idHash: string) => `${prefix}:{console}:session:${idHash}`,
  };
}

const encoder = new TextEncoder();
const base64url = (bytes: ArrayBuffer | Uint8Array) =>
  btoa(String.fromCharCode(...new Uint8Array(bytes))).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));
const SESSION_ID = /^[A-Za-z0-9_-]{43}$/;

/** Compares without leaking where two strings first differ. */
export function sameText(a: string, b: string): boolean {
  const x = encoder.encode(a), y = encoder.encode(b);
  let diff = x.length ^ y.length;
  for (let i = 0; i < Math.max(x.length, y.length); i++) diff |= (x[i] ?? 0) ^ (y[i] ?? 0);
  return diff === 0;
}

/** Creates the console's access control for `token` (ADMIN_TOKEN). */
export async function createAdminAuth(
  { redis, log }: { redis: RedisClient; log: Logger },
  { token, prefix, options = {} }: { token: string; prefix: string; options?: Partial<AdminAuthOptions> },
): Promise<AdminAuth> {
  const { turnMs, maxWaitMs, sessionTtlS } = { ...ADMIN_AUTH_DEFAULTS, ...options };
  const keys = consoleKeys(prefix);
  const key = await crypto.subtle.importKey("raw", encoder.encode(token), { name: "HMAC", hash: "SHA-256" }, false, [
    "sign",
  ]);
  const mac = async (what: string) => base64url(await crypto.subtle.sign("HMAC", key, encoder.encode(what)));
  const sessionMac = (id: string) => mac(`oncely-console-session-v2:${id}`);
  const idHash = async (id: string) => base64url(await crypto.subtle.digest("SHA-256", encoder.encode(id)));
  /** The session id a cookie value carries, when its signature is right (a forgery costs no Redis call). */
  const idOf = async (cookieValue: string) => {
    const [id, proof, extra] = cookieValue.split(".");
    if (!id || !proof || extra !== undefined || !SESSION_ID.test(id)) return null;
    return sameText(proof, await sessionMac(id)) ? id : null;
  };
  const failed = (source: AttemptSource, fields: Record<string, unknown>) =>
    log.warn("console_auth_failed", {
      via: source.via,
      address: source.address,
      forwarded_for: source.forwardedFor?.slice(0, 200) ?? undefined,
      ...fields,
    });

  return {
    mac,
    async check(candidate, source) {
      const [wait, at] = (await TAKE_TURN_SCRIPT.run(redis, [keys.nextTurn], [turnMs, maxWaitMs])) as [number, number];
      if (wait < 0) {
        const retryAfterS = Math.max(1, Math.ceil(at / 1000)); // `at` is then how long the queue is
        failed(source, { reason: "throttled", retry_after_s: retryAfterS });
        return { ok: false, retryAfterS };
      }
      // The token is compared only in this check's turn: a guess sent beside 199 others waits for all of them.
      if (wait > 0) await sleep(wait);
      if (sameText(candidate, token)) {
        // Nobody took a turn after it: the next check need not wait for this one.
        await deleteIfEqual(redis, keys.nextTurn, at + turnMs);
        return { ok: true };
      }
      failed(source, { reason: "wrong_token" });
      // A wrong guess is answered when its turn ends, so even one guesser alone waits a turn per guess.
      await sleep(turnMs);
      return { ok: false };
    },
    async startSession() {
      const id = base64url(crypto.getRandomValues(new Uint8Array(32)));
      await redis.set(keys.session(await idHash(id)), "1", "EX", sessionTtlS);
      return `${id}.${await sessionMac(id)}`;
    },
    async session(cookieValue) {
      const id = await idOf(cookieValue);
      if (id === null) return null;
      return (await redis.exists(keys.session(await idHash(id)))) === 1 ? cookieValue : null;
    },
    async endSession(cookieValue) {
      const id = await idOf(cookieValue);
      if (id !== null) await redis.del(keys.session(await idHash(id)));
    },
  };
}
