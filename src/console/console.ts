/**
 * The operator console: server-rendered HTML under `/console`, no build step,
 * working without JavaScript (a small script only refreshes the numbers).
 * It is behind ADMIN_TOKEN: a bearer header, or a login form that starts a
 * session held in Redis and sets an HttpOnly, SameSite=Strict cookie naming
 * it (never the token); both go through one throttled, logged check
 * (`admin_auth.ts`). Every action is a POST carrying a CSRF token. Every value
 * from data is escaped by the `html` tag, and the pages never show keys or
 * secrets.
 */
import { JOB_ID } from "../summaries/schemas.ts";
import type { Sql } from "postgres";
import type { RedisClient } from "../clients.ts";
import type { Logger } from "../log/logger.ts";
import { dlqCommand } from "../cli/dlq_command.ts";
import { listOutbox, outboxBacklog, retryFailed, rowsOfJob } from "../outbox/outbox_store.ts";
import { pagesOfDeadLetters } from "../queue/dead_letter.ts";
import { allLanes } from "../summaries/all_lanes.ts";
import type { ServiceKeys } from "../summaries/keys.ts";
import { traceIdOf } from "../tracing.ts";
import { attemptsOf, decidedJob, doneLastMinute } from "../jobs/job_store.ts";
import { Html, html, raw } from "./html.ts";
import {
  ADMIN_AUTH_DEFAULTS,
  type AdminAuthOptions,
  type AttemptSource,
  createAdminAuth,
  sameText,
  type Verdict,
} from "./admin_auth.ts";
import { readFormBody } from "../http/body.ts";
import { AsyncLocalStorage } from "node:async_hooks";

/** What the console reads and acts on. */
export interface ConsoleDeps {
  redis: RedisClient;
  sql: Sql;
  keys: ServiceKeys;
  log: Logger;
  /** ADMIN_TOKEN. */
  token: string;
  /** MAX_BODY_BYTES: a form above it is refused (413) before anything is checked. */
  maxBodyBytes: number;
  /** How long a form may take to arrive; default 10 s (`BODY_DEADLINE_MS`). */
  bodyDeadlineMs?: number;
  /** The token check's pace and the sessions' lifetime; defaults in `ADMIN_AUTH_DEFAULTS`. */
  auth?: Partial<AdminAuthOptions>;
  /** The shared limiter and breaker, as `deno task provider status` prints it; absent without one. */
  providerStatus?: () => Promise<string[]>;
}

const COOKIE = "oncely_console";
const PAGE_ROWS = 200;
const HEADERS = {
  "content-type": "text/html; charset=utf-8",
  "cache-control": "no-store",
  "x-content-type-options": "nosniff",
  "referrer-policy": "no-referrer",
  "x-frame-options": "DENY",
  // A second line behind escaping: no inline script runs, nothing loads from elsewhere.
  "content-security-policy": "default-src 'none'; style-src 'self'; script-src 'self'; img-src 'self'; " +
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
};

/** The peer of a request, as `Deno.serve` passes it to a handler. */
export interface ConsoleClient {
  remoteAddr?: Deno.Addr;
}

/** The console's handler for requests whose path starts with `/console`. */
export type ConsoleHandler = (req: Request, path: string, client?: ConsoleClient) => Promise<Response>;

/** Creates the console's handler for requests whose path starts with `/console`. */
export async function createConsole(deps: ConsoleDeps): Promise<ConsoleHandler> {
  const { redis, sql, keys, token } = deps;
  const sessionTtlS = deps.auth?.sessionTtlS ?? ADMIN_AUTH_DEFAULTS.sessionTtlS;
  // The cookie names a session held in Redis (for sessionTtlS, whatever the browser keeps) and is signed with
  // the token: signing out deletes the session, and changing ADMIN_TOKEN signs everyone out.
  const admin = await createAdminAuth({ redis, log: deps.log }, { token, prefix: keys.prefix, options: deps.auth });
  const formOf = (req: Request) => readFormBody(req, { maxBytes: deps.maxBodyBytes, deadlineMs: deps.bodyDeadlineMs });
  // The CSRF token of the request being handled: bound to its session.
  const requestCsrf = new AsyncLocalStorage<string>();

  const sourceOf = (req: Request, via: AttemptSource["via"], client?: ConsoleClient): AttemptSource => ({
    via,
    address: client?.remoteAddr && "hostname" in client.remoteAddr ? client.remoteAddr.hostname : undefined,
    forwardedFor: req.headers.get("x-forwarded-for"),
  });
  const cookieOf = (req: Request) =>
    (req.headers.get("cookie") ?? "").split(/;\s*/).find((c) => c.startsWith(`${COOKIE}=`))?.slice(COOKIE.length + 1);

  /**
   * The request's session (its cookie value, or "bearer"), null when it is
   * not signed in, or the answer to a wrong or throttled bearer token. A
   * `Bearer` header is a check of the token like the form's: same turns, same log.
   */
  async function sessionOf(req: Request, client?: ConsoleClient): Promise<string | null | Response> {
    const auth = req.headers.get("authorization");
    if (auth !== null && /^bearer /i.test(auth)) {
      const verdict = await admin.check(auth.slice(7).trim(), sourceOf(req, "bearer", client));
      if (verdict.ok) return "bearer";
      return refused(verdict);
    }
    const cookie = cookieOf(req);
    return cookie ? await admin.session(cookie) : null;
  }
  const csrfFor = (session: string) => admin.mac(`oncely-console-csrf-v1:${session}`);

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

  const page = (title: string, body: Html, { status = 200, note }: { status?: number; note?: string } = {}) =>
    new Response(
      html`
        <!doctype html>
        <html lang="en">
          <head>
            <meta charset="utf-8">
            <meta name="viewport" content="width=device-width, initial-scale=1">
            <title>${title} · Oncely console</title>
            <link rel="stylesheet" href="/console/app.css">
          </head>
          <body data-refresh="5">
            <header><strong>Oncely</strong>
        <nav><a href="/console">Queues</a> <a href="/console/workers">Workers</a> <a href="/console/dead-letters">Dead letters</a>
        <a href="/console/outbox">Outbox</a> <a href="/console/provider">Provider</a></nav>
        <form method="get" action="/console/jobs"><input name="id" placeholder="job id" aria-label="job id" size="38">
        <button>Find job</button></form>
        <form method="post" action="/console/logout"><input type="hidden" name="csrf" value="${requestCsrf.getStore() ??
          ""}"><button>Sign out</button></form>
        <label><input type="checkbox" id="auto-refresh"> refresh every 5 s</label></header>
            <main><h1>${title}</h1>${note ? html`<p class="note" role="status">${note}</p>` : ""}${body}</main>
            <script src="/console/app.js"></script>
          </body>
        </html>
      `.text,
      { status, headers: HEADERS },
    );

  const actionButton = (action: string, label: string, fields: Record<string, string> = {}, disabled = false) =>
    html`
      <form method="post" action="${action}"
        class="inline"><input type="hidden" name="csrf" value="${requestCsrf.getStore() ?? ""}">${Object.entries(fields)
          .map(([k, v]) => html`<input type="hidden" name="${k}" value="${v}">`)}<button${disabled
          ? raw(" disabled")
          : ""}>${label}</button></form>
    `;

  const table = (columns: string[], rows: Html[][], empty: string) =>
    rows.length === 0 ? html`<p class="empty">${empty}</p>` : html`
      <table>
        <thead>
          <tr>${columns.map((c) => html`<th>${c}</th>`)}</tr>
        </thead>
        <tbody>${rows.map((r) => html`<tr>${r.map((cell) => html`<td>${cell}</td>`)}</tr>`)}</tbody>
      </table>
    `;

  const ago = (
    ms: number,
  ) => (ms < 1_000
    ? `${Math.round(ms)} ms`
    : ms < 120_000
    ? `${(ms / 1000).toFixed(1)} s`
    : `${(ms / 60_000).toFixed(1)} min`);
  const jobLink = (
    id: string | undefined,
  ) => (id ? html`<a href="/console/jobs/${id}"><code>${id}</code></a>` : html``);

  async function queuesPage(note?: string): Promise<Response> {
    const lanes = await allLanes(redis, keys);
    const donePerMinute = new Map(
      (await doneLastMinute(sql)).map((
        r,
      ) => [r.tenant, r.n]),
    );
    const rows = await Promise.all(lanes.map(async (lane) => {
      const [depth, pending, oldest] = await Promise.all([
        redis.xlen(lane.keys.stream),
        redis.xpending(lane.keys.stream, lane.keys.group).then((s) => Number((s as [number])[0] ?? 0), () => 0),
        redis.xrange(lane.keys.stream, "-", "+", "COUNT", 1),
      ]);
      const oldestMs = oldest[0] ? Date.now() - Number(oldest[0][0].split("-")[0]) : undefined;
      return [
        html`${lane.tenant ?? "(before lanes)"}`,
        html`${depth}`,
        html`${pending}`,
        html`${lane.tenant === null ? "" : donePerMinute.get(lane.tenant) ?? 0}`,
        html`${oldestMs === undefined ? "" : ago(oldestMs)}`,
      ];
    }));
    return page(
      "Queues",
      table(
        ["tenant", "queued (in the stream)", "in flight", "done in the last minute", "oldest waiting"],
        rows,
        "No lanes yet.",
      ),
      { note },
    );
  }

  async function workersPage(): Promise<Response> {
    const byName = new Map<string, { lanes: number; pending: number; idle: number }>();
    for (const lane of await allLanes(redis, keys)) {
      const consumers =
        await (redis.call("XINFO", "CONSUMERS", lane.keys.stream, lane.keys.group) as Promise<unknown[][]>)
          .catch(() => []);
      for (const c of consumers) {
        const f = new Map<string, unknown>();
        for (let i = 0; i + 1 < c.length; i += 2) f.set(String(c[i]), c[i + 1]);
        const name = String(f.get("name"));
        const entry = byName.get(name) ?? { lanes: 0, pending: 0, idle: Infinity };
        entry.lanes++;
        entry.pending += Number(f.get("pending") ?? 0);
        entry.idle = Math.min(entry.idle, Number(f.get("idle") ?? 0));
        byName.set(name, entry);
      }
    }
    const rows = [...byName].sort(([a], [b]) => a.localeCompare(b)).map(([name, w]) => [
      html`<code>${name}</code>`,
      html`${w.lanes}`,
      html`${w.pending}`,
      html`${ago(w.idle)}`,
    ]);
    return page("Workers", table(["consumer", "lanes", "pending", "idle"], rows, "No worker has read a lane yet."));
  }

  async function deadLettersPage(note?: string): Promise<Response> {
    const rows: Html[][] = [];
    let total = 0;
    for (const lane of await allLanes(redis, keys)) {
      total += await redis.xlen(lane.keys.dead);
      for await (const batch of pagesOfDeadLetters(redis, lane.keys, PAGE_ROWS)) {
        for (const d of batch) {
          if (rows.length >= PAGE_ROWS) break;
          let excerpt = "";
          try {
            excerpt = String((JSON.parse(d.fields.payload ?? "{}") as { text?: unknown }).text ?? "").slice(0, 160);
          } catch {
            /* a truncated payload is not JSON: the raw prefix is shown */
            excerpt = (d.fields.payload ?? "").slice(0, 160);
          }
          const fields: Record<string, string> = { id: d.id };
          if (lane.tenant !== null) fields.tenant = lane.tenant;
          rows.push([
            html`${d.fields.tenant ?? ""}`,
            jobLink(d.fields.job_id),
            html`<span class="reason">${d.reason}</span>`,
            html`${d.deliveries}`,
            html`${d.dead_at}`,
            html`<span class="excerpt">${excerpt}</span>`,
            d.truncated.length || d.expired
              ? html`<span title="${
                d.truncated.length ? "payload truncated" : "older than 7 days"
              }: the client must resubmit">not replayable</span>`
              : actionButton("/console/dead-letters/replay", "Replay", fields),
          ]);
        }
        if (rows.length >= PAGE_ROWS) break;
      }
    }
    const body = html`<p>${total} dead letter(s)${total > rows.length ? ` (the oldest ${rows.length} shown)` : ""}.</p>
${total ? actionButton("/console/dead-letters/replay", "Replay all", { all: "1" }) : ""}
${
      table(
        ["tenant", "job", "reason", "deliveries", "dead at", "document (start)", ""],
        rows,
        "The dead-letter streams are empty.",
      )
    }`;
    return page("Dead letters", body, { note });
  }

  async function outboxPage(note?: string): Promise<Response> {
    const [backlog, failed] = await Promise.all([
      outboxBacklog(sql),
      listOutbox(sql, { failed: true, limit: PAGE_ROWS }),
    ]);
    const rows = failed.map((r) => [
      html`${r.id}`,
      html`${r.topic}`,
      html`<code>${r.dedupe_key}</code>`,
      html`${r.attempts}`,
      html`<span class="reason">${r.last_error ?? ""}</span>`,
      actionButton("/console/outbox/retry", "Retry", { id: r.id }),
    ]);
    const body = html`
      <dl class="figures">
        <dt>unsent</dt>
        <dd>${backlog.unsent}</dd>
        <dt>failed</dt>
        <dd>${backlog.failed}</dd>
        <dt>oldest unsent</dt>
        <dd>${backlog.unsent ? ago(backlog.oldest_unsent_s * 1000) : "none"}</dd>
      </dl>
      ${backlog.failed ? actionButton("/console/outbox/retry", "Retry all failed", { all: "1" }) : ""}
      <h2>Failed rows</h2>${table(["id", "topic", "dedupe key", "attempts", "last error", ""], rows, "No failed rows.")}
    `;
    return page("Outbox", body, { note });
  }

  async function providerPage(): Promise<Response> {
    if (!deps.providerStatus) {
      return page(
        "Provider",
        html`<p class="empty">No shared limiter or breaker: the model is the local extractive one.</p>`,
      );
    }
    return page("Provider", html`<pre>${(await deps.providerStatus()).join("\n")}</pre>`);
  }

  async function jobPage(jobId: string): Promise<Response> {
    if (!JOB_ID.test(jobId)) return page("Job", html`<p>Not a job id: <code>${jobId}</code></p>`, { status: 404 });
    const [decided] = await decidedJob(sql, jobId);
    let state: { tenant: string; status: string; error?: string } | undefined = decided
      ? { tenant: decided.tenant, status: decided.outcome }
      : undefined;
    if (!state) {
      for (const lane of await allLanes(redis, keys)) {
        const record = await redis.hgetall(lane.keys.job(jobId));
        if (record.tenant) {
          state = { tenant: record.tenant, status: record.status ?? "queued", error: record.error };
          break;
        }
      }
    }
    if (!state) return page("Job", html`<p>No job <code>${jobId}</code>.</p>`, { status: 404 });
    const [attempts, outbox] = await Promise.all([
      attemptsOf(sql, jobId),
      rowsOfJob(sql, jobId),
    ]);
    const traceId = traceIdOf(outbox[0]?.traceparent ?? undefined);
    const rows = attempts.map((a) => [
      html`${a.delivery}`,
      html`${a.attempt}`,
      html`${a.started_at.toISOString()}`,
      html`${Math.round(a.duration_ms)} ms`,
      html`${a.outcome}`,
      html`${a.status ?? ""}`,
      html`${a.prompt_tokens ?? ""} / ${a.completion_tokens ?? ""}`,
      html`${a.model}`,
      html`<code>${a.provider_request_id ?? ""}</code>`,
      html`${a.error ?? ""}`,
    ]);
    const body = html`<dl class="figures"><dt>job</dt><dd><code id="job-id">${jobId}</code></dd>
<dt>tenant</dt><dd>${state.tenant}</dd><dt>status</dt><dd id="job-status">${state.status}</dd>
${
      state.error
        ? html`
          <dt>error</dt>
          <dd class="reason">${state.error}</dd>
        `
        : ""
    }
<dt>notification</dt><dd>${
      outbox[0]
        ? `${outbox[0].topic}: ${outbox[0].sent ? "sent" : outbox[0].failed ? "failed" : "pending"}`
        : "none yet"
    }</dd>
<dt>trace</dt><dd>${
      traceId
        ? html`<a href="#trace" id="trace-id" data-trace-id="${traceId}"><code>${traceId}</code></a>`
        : "not traced"
    }</dd></dl>
${
      decided?.summary
        ? html`
          <h2>Summary</h2>
          <pre class="summary">${decided.summary}</pre>
        `
        : ""
    }
<h2>Model attempts</h2>${
      table(
        [
          "delivery",
          "attempt",
          "started",
          "took",
          "outcome",
          "status",
          "tokens in / out",
          "model",
          "request id",
          "error",
        ],
        rows,
        "No model call yet.",
      )
    }`;
    return page("Job", body);
  }

  const back = (to: string, note: string) =>
    new Response(null, { status: 303, headers: { location: `${to}?note=${encodeURIComponent(note)}` } });

  async function act(req: Request, path: string, session: string): Promise<Response> {
    const fields = await formOf(req);
    if (!sameText(fields.get("csrf") ?? "", requestCsrf.getStore() ?? "")) {
      return page(
        "Refused",
        html`<p>This form has expired or did not come from the console. Go back and try again.</p>`,
        {
          status: 403,
        },
      );
    }
    if (path === "/console/logout") {
      if (session !== "bearer") await admin.endSession(session);
      return new Response(null, {
        status: 303,
        headers: {
          location: "/console/login",
          "set-cookie": `${COOKIE}=; Path=/console; Max-Age=0; HttpOnly; SameSite=Strict`,
        },
      });
    }
    if (path === "/console/dead-letters/replay") {
      const lines: string[] = [];
      const id = fields.get("id"), tenant = fields.get("tenant");
      const args = fields.get("all")
        ? ["replay", "--all"]
        : ["replay", id ?? "", ...(tenant ? ["--tenant", tenant] : [])];
      await dlqCommand({ redis, sql }, keys, args, {
        out: (line) => lines.push(line),
        err: (line) => lines.push(line),
      });
      deps.log.info("console_dead_letters_replayed", { all: Boolean(fields.get("all")), id, tenant });
      return back("/console/dead-letters", lines.at(-1) ?? "Done.");
    }
    if (path === "/console/outbox/retry") {
      const id = fields.get("id");
      const n = await retryFailed(sql, fields.get("all") ? "all" : /^\d+$/.test(id ?? "") ? [id!] : []);
      deps.log.info("console_outbox_retried", { all: Boolean(fields.get("all")), id, rows: n });
      return back("/console/outbox", `${n} row(s) made due again.`);
    }
    return page("Not found", html`<p>No such action.</p>`, { status: 404 });
  }

  function loginPage(status = 200, failed?: Verdict & { ok: false }): Response {
    return new Response(
      html`
        <!doctype html>
        <html lang="en">
          <head>
            <meta charset="utf-8">
            <title>Sign in · Oncely console</title>
            <link rel="stylesheet" href="/console/app.css">
          </head>
          <body>
            <main class="login"><h1>Oncely console</h1>
        ${failed
          ? html`<p class="note" role="alert">${
            failed.retryAfterS === undefined
              ? "That is not the admin token."
              : `Too many failed sign-ins; try again in ${failed.retryAfterS} s.`
          }</p>`
          : ""}
        <form method="post" action="/console/login"><label>Admin token <input type="password" name="token" autocomplete="current-password" required></label>
        <button>Sign in</button></form></main>
          </body>
        </html>
      `.text,
      {
        status,
        headers: failed?.retryAfterS === undefined
          ? HEADERS
          : { ...HEADERS, "retry-after": String(failed.retryAfterS) },
      },
    );
  }

  async function login(req: Request, client?: ConsoleClient): Promise<Response> {
    // Bounded in size and time before any check: the body is the unauthenticated client's.
    const fields = await formOf(req);
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
  }

  return async (req, path, client) => {
    if (path === "/console/app.css") {
      return new Response(CSS, { headers: { "content-type": "text/css", "cache-control": "max-age=300" } });
    }
    if (path === "/console/app.js") {
      return new Response(JS, { headers: { "content-type": "text/javascript", "cache-control": "max-age=300" } });
    }
    if (path === "/console/login") return req.method === "POST" ? await login(req, client) : loginPage();
    const session = await sessionOf(req, client);
    if (session instanceof Response) return session;
    if (!session) {
      if (req.method === "GET" || req.method === "HEAD") {
        return new Response(null, { status: 303, headers: { location: "/console/login" } });
      }
      return page("Sign in first", html`<p><a href="/console/login">Sign in</a>.</p>`, { status: 401 });
    }
    return await requestCsrf.run(await csrfFor(session), () => signedInRoute(req, path, session));
  };

  async function signedInRoute(req: Request, path: string, session: string): Promise<Response> {
    if (req.method === "POST") return await act(req, path, session);
    if (req.method !== "GET" && req.method !== "HEAD") {
      return new Response(null, { status: 405, headers: { allow: "GET, POST" } });
    }
    const note = new URL(req.url).searchParams.get("note")?.slice(0, 300) ?? undefined;
    if (path === "/console" || path === "/console/") return await queuesPage(note);
    if (path === "/console/workers") return await workersPage();
    if (path === "/console/dead-letters") return await deadLettersPage(note);
    if (path === "/console/outbox") return await outboxPage(note);
    if (path === "/console/provider") return await providerPage();
    if (path === "/console/jobs") {
      const id = new URL(req.url).searchParams.get("id")?.trim() ?? "";
      return new Response(null, { status: 303, headers: { location: `/console/jobs/${encodeURIComponent(id)}` } });
    }
    const job = /^\/console\/jobs\/([^/]+)$/.exec(path);
    if (job) {
      let id: string;
      try {
        id = decodeURIComponent(job[1]!);
      } catch {
        id = job[1]!;
      }
      return await jobPage(id);
    }
    return page("Not found", html`<p>No console page at <code>${path}</code>.</p>`, { status: 404 });
  }
}

const CSS = `
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1b1f24;background:#f6f7f9}
header{display:flex;gap:1rem;align-items:center;flex-wrap:wrap;padding:.6rem 1rem;background:#1b2a41;color:#fff}
header a{color:#cfe0ff;margin-right:.6rem} header form{display:inline} main{padding:1rem 1.5rem}
table{border-collapse:collapse;background:#fff;width:100%} th,td{border-bottom:1px solid #e3e6ea;padding:.35rem .5rem;text-align:left;vertical-align:top}
th{background:#eef1f5} .reason,.excerpt{font-family:ui-monospace,monospace;font-size:12px;word-break:break-all}
.note{background:#fff7d6;border:1px solid #e8d48a;padding:.4rem .6rem} .empty{color:#667}
.figures{display:grid;grid-template-columns:max-content 1fr;gap:.2rem 1rem} .figures dt{color:#556}
form.inline{display:inline} pre{background:#fff;border:1px solid #e3e6ea;padding:.6rem;white-space:pre-wrap}
.login{max-width:24rem;margin:4rem auto}
`;

const JS = `
// Optional: reload the page every 5 s while the box is ticked (remembered in this browser).
const box = document.getElementById("auto-refresh");
if (box) {
  box.checked = localStorage.getItem("oncely-console-refresh") === "1";
  box.addEventListener("change", () => localStorage.setItem("oncely-console-refresh", box.checked ? "1" : "0"));
  setInterval(() => { if (box.checked) location.reload(); }, 5000);
}
`;
