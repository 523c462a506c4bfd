/** The console's page frame and the small pieces every page is built from. */
import { Html, html, raw } from "./html.ts";

/** The headers of every HTML answer. */
export const HEADERS = {
  "content-type": "text/html; charset=utf-8",
  "cache-control": "no-store",
  "x-content-type-options": "nosniff",
  "referrer-policy": "no-referrer",
  "x-frame-options": "DENY",
  // A second line behind escaping: no inline script runs, nothing loads from elsewhere.
  "content-security-policy": "default-src 'none'; style-src 'self'; script-src 'self'; img-src 'self'; " +
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
};

/** How many rows a page lists at most. */
export const PAGE_ROWS = 200;

/** What every signed-in page needs: the CSRF token its forms carry (bound to the session). */
export interface View {
  csrf: string;
}

/** A signed-in page: the header with navigation, the title, an optional note, the body. */
export function page(
  view: View,
  title: string,
  body: Html,
  { status = 200, note }: { status?: number; note?: string } = {},
): Response {
  const header = html`<header><strong>Oncely</strong>
      <nav><a href="/console">Queues</a> <a href="/console/workers">Workers</a> <a href="/console/dead-letters">Dead letters</a>
      <a href="/console/outbox">Outbox</a> <a href="/console/provider">Provider</a> <a href="/console/batches">Batches</a>
      <a href="/console/tasks">Tasks</a> <a href="/console/usage">Usage</a></nav>
      <form method="get" action="/console/jobs"><input name="id" placeholder="job id" aria-label="job id" size="38">
      <button>Find job</button></form>
      <form method="post" action="/console/logout"><input type="hidden" name="csrf" value="${view.csrf}"><button>Sign out</button></form>
      <label><input type="checkbox" id="auto-refresh"> refresh every 5 s</label></header>`;
  const main = html`<main><h1>${title}</h1>${
    note ? html`<p class="note" role="status">${note}</p>` : ""
  }${body}</main>`;
  return htmlDocument(`${title} · Oncely console`, html`${header}${main}<script src="/console/app.js"></script>`, {
    status,
    refresh: true,
  });
}

/** A whole HTML answer: the head every console page shares, then `body`. */
export function htmlDocument(
  title: string,
  body: Html,
  { status = 200, refresh = false, headers = HEADERS }: { status?: number; refresh?: boolean; headers?: HeadersInit } =
    {},
): Response {
  return new Response(
    html`
      <!doctype html>
      <html lang="en">
        <head>
          <meta charset="utf-8">
          <meta name="viewport" content="width=device-width, initial-scale=1">
          <title>${title}</title>
          <link rel="stylesheet" href="/console/app.css">
        </head>
        <body${refresh ? raw(' data-refresh="5"') : ""}>${body}</body>
      </html>
    `.text,
    { status, headers },
  );
}

/** A POST button carrying the CSRF token and `fields`. */
export function actionButton(
  view: View,
  action: string,
  label: string,
  fields: Record<string, string> = {},
  disabled = false,
): Html {
  return html`
    <form method="post" action="${action}"
      class="inline"><input type="hidden" name="csrf" value="${view.csrf}">${Object.entries(fields)
        .map(([k, v]) => html`<input type="hidden" name="${k}" value="${v}">`)}<button${disabled
        ? raw(" disabled")
        : ""}>${label}</button></form>
  `;
}

/** A table of `rows`, or the `empty` sentence when there are none. */
export function table(columns: string[], rows: Html[][], empty: string): Html {
  return rows.length === 0 ? html`<p class="empty">${empty}</p>` : html`
    <table>
      <thead>
        <tr>${columns.map((c) => html`<th>${c}</th>`)}</tr>
      </thead>
      <tbody>${rows.map((r) => html`<tr>${r.map((cell) => html`<td>${cell}</td>`)}</tr>`)}</tbody>
    </table>
  `;
}

/** A duration for people: ms, s or min. */
export function ago(ms: number): string {
  return ms < 1_000
    ? `${Math.round(ms)} ms`
    : ms < 120_000
    ? `${(ms / 1000).toFixed(1)} s`
    : `${(ms / 60_000).toFixed(1)} min`;
}

/** A link to a job's page; nothing without an id. */
export function jobLink(id: string | undefined, tenant?: string): Html {
  if (!id) return html``;
  // With its tenant, the job page reads the job's record as the API does, from its tenant's lane alone.
  const query = tenant ? `?tenant=${encodeURIComponent(tenant)}` : "";
  return html`<a href="/console/jobs/${encodeURIComponent(id)}${query}"><code>${id}</code></a>`;
}

/** The redirect after an action: back to `to`, with `note` to show there. */
export function back(to: string, note: string): Response {
  return new Response(null, { status: 303, headers: { location: `${to}?note=${encodeURIComponent(note)}` } });
}

/** The path of a task's page, at `version` when given. */
export function taskPath(tenant: string, name: string, version?: number): string {
  const query = version === undefined ? "" : `?version=${version}`;
  return `/console/tasks/${encodeURIComponent(tenant)}/${encodeURIComponent(name)}${query}`;
}

/** A link to a task's page, at `version` when given. */
export function taskLink(tenant: string, name: string, version?: number, label: string = name): Html {
  return html`<a href="${taskPath(tenant, name, version)}">${label}</a>`;
}

/** A JSON value pretty-printed in a `<pre>`, escaped like any other data (a tenant's input, output or schema). */
export function prettyJson(value: unknown, className: string): Html {
  return html`<pre class="${className}">${JSON.stringify(value, null, 2)}</pre>`;
}
