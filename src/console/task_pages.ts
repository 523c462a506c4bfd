/**
 * The console's task pages: every tenant's tasks at their latest version,
 * and one task's usage, versions and definitions. A definition is a
 * tenant's prompt and schemas, shown as escaped, pretty-printed JSON. Lists
 * read columns (`task_heads`, the versions' sizes); only the definitions a
 * page shows are read, and they are bounded in bytes. The usage is the
 * usage page's figures for the rows naming the task.
 */
import {
  taskCount,
  taskHeads,
  type TaskVersion,
  type TaskVersionHead,
  taskVersionHeads,
  taskVersionsNumbered,
} from "../jobs/task_store.ts";
import { BUILT_IN_TASK } from "../tasks/definition.ts";
import { clockWindow, unknownWindow, type UsageWindow, usageWindow, windowSwitch } from "./chart_windows.ts";
import type { PageDeps } from "./_deps.ts";
import { type Html, html } from "./html.ts";
import { page, PAGE_ROWS, prettyJson, table, taskLink, taskPath, type View } from "./layout.ts";
import { usageCharts, usageFigures, usageTotals, windowSentence } from "./usage_pages.ts";

/**
 * How many versions' whole definitions a task's page shows, newest first, and how many bytes of them (as the
 * store measures them; each may be up to 256 KiB): the newest is always shown, older ones while both bounds
 * hold, the rest by their version's link.
 */
export const DEFINITIONS_SHOWN = 10;
export const DEFINITION_BYTES_SHOWN = 1024 * 1024;

/** What a version's `model` says, for people. */
function models(model: TaskVersionHead["model"]): string {
  return model === null ? "(default)" : [model].flat().join(", ");
}

/** What a version answers: JSON against its output schema, or text. */
function output(head: TaskVersionHead): string {
  return head.has_output_schema ? "JSON (output schema)" : "text";
}

/** Every tenant's tasks (at most `PAGE_ROWS`), each at its latest version, with a link to its page. */
export async function tasksPage({ sql }: PageDeps, view: View): Promise<Response> {
  const [tasks, total] = await Promise.all([taskHeads(sql, { limit: PAGE_ROWS }), taskCount(sql)]);
  const rows = tasks.map((t) => [
    html`${t.tenant}`,
    taskLink(t.tenant, t.name),
    html`${t.version}`,
    html`${t.versions}`,
    html`${t.first_created_at.toISOString()}`,
    html`${t.created_at.toISOString()}`,
    html`${models(t.model)}`,
    html`${output(t)}`,
    html`${t.bytes}`,
    html`${t.total_bytes}`,
  ]);
  const shown = total > rows.length ? ` (the first ${rows.length} shown)` : "";
  const body = html`<p>${total} task(s)${shown}; <code>${BUILT_IN_TASK}</code> is built in for every tenant.</p>
${
    table(
      [
        "tenant",
        "task",
        "latest version",
        "versions",
        "created",
        "latest version created",
        "models",
        "output",
        "bytes (latest)",
        "bytes (all versions)",
      ],
      rows,
      "No tenant has defined a task yet (PUT /v1/tasks/{name}).",
    )
  }`;
  return page(view, "Tasks", body);
}

/**
 * The usage of `tenant`'s task `name`, all versions, over `win`: the usage page's figures and charts for the
 * `model_attempts` and `cache_hits` rows naming the task. The 429s and budgets are the tenant's, on its usage page.
 */
async function taskUsage(
  deps: PageDeps,
  tenant: string,
  name: string,
  win: UsageWindow,
  version?: string,
): Promise<Html> {
  const now = deps.now?.() ?? Date.now();
  const { window, buckets } = clockWindow(now, win.widthMs, win.count);
  const f = await usageFigures(deps.sql, { tenant, task: name, window, buckets });
  const tenantUsage = `/console/usage?${new URLSearchParams({ tenant, window: win.name })}`;
  return html`<h2 id="usage">Usage (all versions)</h2>${windowSwitch(taskPath(tenant, name), { version }, win)}
<p>The model calls and cache hits of this task's runs, ${windowSentence(win, buckets, now)}. The 429s and budgets
  are the tenant's: <a href="${tenantUsage}">its usage page</a>.</p>
${usageTotals(f)}
<div class="charts">${usageCharts(f, { who: `task ${name} of tenant ${tenant}`, win, buckets })}</div>`;
}

/**
 * One task: its usage over `window` (`1h`, `24h` by default, or `7d`; another is a `400`), every version (when,
 * models, output, bytes), and the whole definitions of the newest (at most {@linkcode DEFINITIONS_SHOWN} and
 * {@linkcode DEFINITION_BYTES_SHOWN}), or of `version` alone.
 */
export async function taskPage(
  deps: PageDeps,
  view: View,
  tenant: string,
  name: string,
  { version, window: windowName }: { version?: string; window?: string } = {},
): Promise<Response> {
  const { sql } = deps;
  const title = `Task ${name}`;
  if (version !== undefined && !/^[1-9]\d{0,8}$/.test(version)) {
    return page(view, title, html`<p>Not a version: <code>${version}</code></p>`, { status: 404 });
  }
  const win = usageWindow(windowName);
  if (!win) return unknownWindow(view, title, taskPath(tenant, name), { version }, windowName!);
  const heads = await taskVersionHeads(sql, tenant, name);
  const shown: TaskVersion[] = await taskVersionsNumbered(
    sql,
    tenant,
    name,
    version === undefined
      ? shownVersions(heads)
      : heads.some((h) => h.version === Number(version))
      ? [Number(version)]
      : [],
  );
  if (heads.length === 0 || shown.length === 0) {
    const what = version === undefined ? "" : ` version ${version}`;
    return page(view, title, html`<p>No task <code>${name}</code>${what} of tenant <code>${tenant}</code>.</p>`, {
      status: 404,
    });
  }
  const rows = heads.map((h) => [
    taskLink(tenant, name, h.version, String(h.version)),
    html`${h.created_at.toISOString()}`,
    html`${models(h.model)}`,
    html`${output(h)}`,
    html`${h.bytes}`,
  ]);
  const note = version !== undefined
    ? html`<p>Version ${version} alone; <a href="${taskPath(tenant, name)}">the newest versions</a>.</p>`
    : heads.length > shown.length
    ? html`<p>The ${shown.length} newest definitions are shown; older ones by their version's link.</p>`
    : "";
  const body = html`
    <dl class="figures">
      <dt>tenant</dt>
      <dd id="task-tenant">${tenant}</dd>
      <dt>task</dt>
      <dd id="task-name">${name}</dd>
      <dt>versions</dt>
      <dd>${heads.length}</dd>
      <dt>latest version</dt>
      <dd>${heads[0]!.version}</dd>
    </dl>
    ${await taskUsage(deps, tenant, name, win, version)}
    <h2>Versions</h2>${table(["version", "created", "models", "output", "bytes"], rows, "No versions.")}
    ${note}
    ${shown.map((v) =>
      html`<h2 id="v${v.version}">Version ${v.version}</h2><p>Created ${v.created_at.toISOString()}.</p>${
        prettyJson(v.definition, "definition")
      }`
    )}
  `;
  return page(view, title, body);
}

/** The newest versions whose definitions a task's page shows: see {@linkcode DEFINITIONS_SHOWN}. */
function shownVersions(heads: TaskVersionHead[]): number[] {
  const shown: number[] = [];
  let bytes = 0;
  for (const head of heads) {
    if (shown.length >= DEFINITIONS_SHOWN || (shown.length > 0 && bytes + head.bytes > DEFINITION_BYTES_SHOWN)) break;
    shown.push(head.version);
    bytes += head.bytes;
  }
  return shown;
}
