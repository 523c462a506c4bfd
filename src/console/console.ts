/**
 * The operator console: server-rendered HTML under `/console`, no build step,
 * working without JavaScript (a small script only refreshes the numbers).
 * It is behind ADMIN_TOKEN: a bearer header, or a login form that starts a
 * session held in Redis and sets an HttpOnly, SameSite=Strict cookie naming
 * it (never the token); both go through one throttled, logged check
 * (`admin_auth.ts`, `session.ts`). Every action is a POST carrying a CSRF
 * token (`actions.ts`). Every value from data is escaped by the `html` tag,
 * and the pages (`pages.ts`) never show keys or secrets.
 */
import { act } from "./actions.ts";
import { asset } from "./assets.ts";
import { batchesPage } from "./batch_pages.ts";
import type { ConsoleDeps } from "./_deps.ts";
import { html } from "./html.ts";
import { page } from "./layout.ts";
import { deadLettersPage, jobPage, outboxPage, providerPage, queuesPage, workersPage } from "./pages.ts";
import { taskPage, tasksPage } from "./task_pages.ts";
import { usagePage } from "./usage_pages.ts";
import { type ConsoleClient, createSessions, type SignedInRequest } from "./session.ts";

export type { ConsoleClient } from "./session.ts";
export type { ConsoleDeps } from "./_deps.ts";

/** The console's handler for requests whose path starts with `/console`. */
export type ConsoleHandler = (req: Request, path: string, client?: ConsoleClient) => Promise<Response>;

/** Creates the console's handler for requests whose path starts with `/console`. */
export async function createConsole(deps: ConsoleDeps): Promise<ConsoleHandler> {
  const sessions = await createSessions(deps, {
    token: deps.token,
    prefix: deps.keys.prefix,
    auth: deps.auth,
    maxBodyBytes: deps.maxBodyBytes,
    bodyDeadlineMs: deps.bodyDeadlineMs,
  });
  return async (req, path, client) => {
    const served = asset(path);
    if (served) return served;
    if (path === "/console/login") return await sessions.login(req, client);
    const session = await sessions.of(req, client);
    if (session instanceof Response) return session;
    if (!session) {
      if (req.method === "GET" || req.method === "HEAD") {
        return new Response(null, { status: 303, headers: { location: "/console/login" } });
      }
      return page({ csrf: "" }, "Sign in first", html`<p><a href="/console/login">Sign in</a>.</p>`, { status: 401 });
    }
    return await signedIn({ deps, sessions, view: { csrf: await sessions.csrf(session) }, req, path, session });
  };
}

/** Routes a signed-in request: POSTs are actions, GETs (and HEADs) pages. */
async function signedIn(request: SignedInRequest): Promise<Response> {
  const { deps, view, req, path } = request;
  if (req.method === "POST") return await act(request);
  if (req.method !== "GET" && req.method !== "HEAD") {
    return new Response(null, { status: 405, headers: { allow: "GET, POST" } });
  }
  const url = new URL(req.url);
  const note = url.searchParams.get("note")?.slice(0, 300) ?? undefined;
  if (path === "/console" || path === "/console/") {
    return await queuesPage(deps, view, note, url.searchParams.get("window") ?? undefined);
  }
  if (path === "/console/usage") {
    const tenant = url.searchParams.get("tenant") || undefined;
    return await usagePage(deps, view, { tenant, window: url.searchParams.get("window") || undefined });
  }
  if (path === "/console/workers") return await workersPage(deps, view);
  if (path === "/console/dead-letters") return await deadLettersPage(deps, view, note);
  if (path === "/console/outbox") return await outboxPage(deps, view, note);
  if (path === "/console/provider") return await providerPage(deps, view);
  if (path === "/console/batches") return await batchesPage(deps, view);
  if (path === "/console/tasks") return await tasksPage(deps, view);
  const task = /^\/console\/tasks\/([^/]+)\/([^/]+)$/.exec(path);
  if (task) {
    return await taskPage(deps, view, decoded(task[1]!), decoded(task[2]!), {
      version: url.searchParams.get("version") ?? undefined,
      window: url.searchParams.get("window") || undefined,
    });
  }
  if (path === "/console/jobs") {
    const id = url.searchParams.get("id")?.trim() ?? "";
    return new Response(null, { status: 303, headers: { location: `/console/jobs/${encodeURIComponent(id)}` } });
  }
  const job = /^\/console\/jobs\/([^/]+)$/.exec(path);
  if (job) return await jobPage(deps, view, decoded(job[1]!), url.searchParams.get("tenant") || undefined);
  return page(view, "Not found", html`<p>No console page at <code>${path}</code>.</p>`, { status: 404 });
}

/** A path segment, percent-decoded when it can be. */
function decoded(segment: string): string {
  try {
    return decodeURIComponent(segment);
  } catch {
    return segment;
  }
}
