/**
 * Who is signed in to the console: the sign-in form and its page, the
 * session cookie (naming a session held in Redis, never the token), the
 * `Bearer` header, signing out, and the CSRF token bound to a session. Every
 * check of the token goes through `admin_auth.ts` (throttled and logged).
 */
import type { RedisClient } from "../clients.ts";
import { readFormBody } from "../http/body.ts";
import type { Logger } from "../log/logger.ts";
import {
  ADMIN_AUTH_DEFAULTS,
  type AdminAuthOptions,
  type AttemptSource,
  createAdminAuth,
  type Verdict,
} from "./admin_auth.ts";
import { html } from "./html.ts";
import type { ConsoleDeps } from "./_deps.ts";
import { HEADERS, htmlDocument, type View } from "./layout.ts";

/** The peer of a request, as `Deno.serve` passes it to a handler. */
export interface ConsoleClient {
  remoteAddr?: Deno.Addr;
}

const COOKIE = "oncely_console";

/** A request by a signed-in operator, with what answering it needs. */
export interface SignedInRequest {
  deps: ConsoleDeps;
  sessions: Sessions;
  /** The session's page state: its CSRF token. */
  view: View;
  req: Request;
  path: string;
  /** The session: its cookie value, or "bearer". */
  session: string;
}

/** The console's sessions: who a request is, signing in and out, and each session's CSRF token. */
export interface Sessions {
  /**
   * The request's session (its cookie value, or "bearer"), null when it is
   * not signed in, or the answer to a wrong or throttled bearer token.
   */
  of(req: Request, client?: ConsoleClient): Promise<string | null | Response>;
  /** The CSRF token of forms shown to `session`. */
  csrf(session: string): Promise<string>;
  /** The sign-in page (GET), or a check of the form's token that starts a session (POST). */
  login(req: Request, client?: ConsoleClient): Promise<Response>;
  /** Ends the session (a bearer header has none) and clears the cookie. */
  logout(session: string): Promise<Response>;
  /** Reads a form within MAX_BODY_BYTES and the body deadline. */
  form(req: Request): Promise<URLSearchParams>;
}

/** Creates the console's sessions, held in Redis under `prefix` and signed with `token`. */
export async function createSessions(
  { redis, log }: { redis: RedisClient; log: Logger },
  { token, prefix, auth, maxBodyBytes, bodyDeadlineMs }: {
    token: string;
    prefix: string;
    auth?: Partial<AdminAuthOptions>;
    maxBodyBytes: number;
    bodyDeadlineMs?: number;
  },
): Promise<Sessions> {
  const sessionTtlS = auth?.sessionTtlS ?? ADMIN_AUTH_DEFAULTS.sessionTtlS;
  // The cookie names a session held in Redis (for sessionTtlS, whatever the browser keeps) and is signed with
  // the token: signing out deletes the session, and changing ADMIN_TOKEN signs everyone out.
  const admin = await createAdminAuth({ redis, log }, { token, prefix, options: auth });
  const form = (req: Request) => readFormBody(req, { maxBytes: maxBodyBytes, deadlineMs: bodyDeadlineMs });
  const sourceOf = (req: Request, via: AttemptSource["via"], client?: ConsoleClient): AttemptSource => ({
    via,
    address: client?.remoteAddr && "hostname" in client.remoteAddr ? client.remoteAddr.hostname : undefined,
    forwardedFor: req.headers.get("x-forwarded-for"),
  });
  const cookieOf = (req: Request) =>
    (req.headers.get("cookie") ?? "").split(/;\s*/).find((c) => c.startsWith(`${COOKIE}=`))?.slice(COOKIE.length + 1);

  return {
    form,
    // A `Bearer` header is a check of the token like the form's: same turns, same log.
    async of(req, client) {
      const authorization = req.headers.get("authorization");
      if (authorization !== null && /^bearer /i.test(authorization)) {
        const verdict = await admin.check(authorization.slice(7).trim(), sourceOf(req, "bearer", client));
        if (verdict.ok) return "bearer";
        return refused(verdict);
      }
      const cookie = cookieOf(req);
      return cookie ? await admin.session(cookie) : null;
    },
    csrf: (session) => admin.mac(`oncely-console-csrf-v1:${session}`),
    async login(req, client) {
      if (req.method !== "POST") return loginPage();
      // Bounded in size and time before any check: the body is the unauthenticated client's.
      const fields = await form(req);
      const verdict = await admin.check(fields.get("token") ?? "", sourceOf(req, "form", client));
      if (!verdict.ok) return loginPage(verdict.retryAfterS === undefined ? 401 : 429, verdict);
      const secure = new URL(req.url).protocol === "https:" || req.headers.get("x-forwarded-proto") === "https";
      const session = await admin.startSession();
      return new Response(null, {
        status: 303,
        headers: {
          location: "/console",
          "set-cookie": `${COOKIE}=${session}; Path=/console; Max-Age=${sessionTtlS}; HttpOnly; SameSite=Strict${
            secure ? "; Secure" : ""
          }`,
        },
      });
    },
    async logout(session) {
      if (session !== "bearer") await admin.endSession(session);
      return new Response(null, {
        status: 303,
        headers: {
          location: "/console/login",
          "set-cookie": `${COOKIE}=; Path=/console; Max-Age=0; HttpOnly; SameSite=Strict`,
        },
      });
    },
  };
}

/** A refused bearer token: 401, or 429 with Retry-After when the check was not even made. */
function refused(verdict: Verdict & { ok: false }): Response {
  const throttled = verdict.retryAfterS !== undefined;
  return new Response(
    html`
      <!doctype html>
      <title>Refused · Oncely console</title>
      <p>${throttled
        ? `Too many failed attempts; try again in ${verdict.retryAfterS} s.`
        : "That is not the admin token."}</p>
    `.text,
    {
      status: throttled ? 429 : 401,
      headers: {
        ...HEADERS,
        ...(throttled ? { "retry-after": String(verdict.retryAfterS) } : { "www-authenticate": "Bearer" }),
      },
    },
  );
}

/** The sign-in form, with why the last attempt failed. */
function loginPage(status = 200, failed?: Verdict & { ok: false }): Response {
  const why = failed
    ? html`<p class="note" role="alert">${
      failed.retryAfterS === undefined
        ? "That is not the admin token."
        : `Too many failed sign-ins; try again in ${failed.retryAfterS} s.`
    }</p>`
    : "";
  return htmlDocument(
    "Sign in · Oncely console",
    html`<main class="login"><h1>Oncely console</h1>
      ${why}
      <form method="post" action="/console/login"><label>Admin token <input type="password" name="token" autocomplete="current-password" required></label>
      <button>Sign in</button></form></main>`,
    {
      status,
      headers: failed?.retryAfterS === undefined ? HEADERS : { ...HEADERS, "retry-after": String(failed.retryAfterS) },
    },
  );
}
