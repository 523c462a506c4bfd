/** The console's signed-in pages, one function each: queues, workers, dead letters, outbox, provider, a job or run. */
import { listOutbox, outboxBacklog, rowsOfJob } from "../outbox/outbox_store.ts";
import { attemptedTaskOf, attemptsOf, decidedRun, doneLastMinute, type JobAttempt } from "../jobs/job_store.ts";
import { deadLetterCount, deadLetterPages, laneStats, oldestAgeMs, workers } from "../queue/inspector.ts";
import { allLanes } from "../runs/all_lanes.ts";
import { readJobRecord } from "../runs/job_status.ts";
import { JOB_ID } from "../runs/shapes.ts";
import { BUILT_IN_TASK } from "../tasks/definition.ts";
import { traceIdOf } from "../tracing.ts";
import type { PageDeps } from "./_deps.ts";
import { Html, html } from "./html.ts";
import { queueCharts } from "./usage_pages.ts";
import { actionButton, ago, jobLink, page, PAGE_ROWS, prettyJson, table, taskLink, type View } from "./layout.ts";

export type { PageDeps } from "./_deps.ts";

/**
 * Each lane: its depth, in-flight count, jobs done in the last minute, and how long its oldest entry waits;
 * then the charts of throughput and latency (over the last hour, or 24 hours with `window` "24h").
 */
export async function queuesPage(deps: PageDeps, view: View, note?: string, window?: string): Promise<Response> {
  const { redis, sql, keys } = deps;
  const lanes = await allLanes(redis, keys);
  const done = new Map((await doneLastMinute(sql)).map((r) => [r.tenant, r.n]));
  const rows = await Promise.all(lanes.map(async (lane) => {
    const [{ depth, pending }, oldestMs] = await Promise.all([
      laneStats(redis, lane.keys),
      oldestAgeMs(redis, lane.keys),
    ]);
    return [
      html`${lane.tenant}`,
      html`${depth}`,
      html`${pending}`,
      html`${lane.tenant === null ? "" : done.get(lane.tenant) ?? 0}`,
      html`${oldestMs === undefined ? "" : ago(oldestMs)}`,
    ];
  }));
  const lanesTable = table(
    ["tenant", "queued (in the stream)", "in flight", "done in the last minute", "oldest waiting"],
    rows,
    "No lanes yet.",
  );
  return page(view, "Queues", html`${lanesTable}${await queueCharts(deps, window)}`, { note });
}

/** Each consumer over all lanes: how many lanes it reads, its pending entries, how long it has been idle. */
export async function workersPage({ redis, keys }: PageDeps, view: View): Promise<Response> {
  const rows = (await workers(redis, await allLanes(redis, keys))).map((w) => [
    html`<code>${w.name}</code>`,
    html`${w.lanes}`,
    html`${w.pending}`,
    html`${ago(w.idle)}`,
  ]);
  return page(view, "Workers", table(["consumer", "lanes", "pending", "idle"], rows, "No worker has read a lane yet."));
}

/** The start of a dead letter's document: its text, or the raw prefix of a payload that is not JSON. */
function excerptOf(payload: string | undefined): string {
  try {
    return String((JSON.parse(payload ?? "{}") as { text?: unknown }).text ?? "").slice(0, 160);
  } catch {
    /* a truncated payload is not JSON: the raw prefix is shown */
    return (payload ?? "").slice(0, 160);
  }
}

/** The oldest `PAGE_ROWS` dead letters over all lanes, each with a Replay button when it can run again. */
export async function deadLettersPage({ redis, keys }: PageDeps, view: View, note?: string): Promise<Response> {
  const rows: Html[][] = [];
  const lanes = await allLanes(redis, keys);
  let total = 0;
  for (const lane of lanes) total += await deadLetterCount(redis, lane.keys);
  for await (const batch of deadLetterPages(redis, lanes, PAGE_ROWS)) {
    for (const d of batch) {
      if (rows.length >= PAGE_ROWS) break;
      const fields: Record<string, string> = { id: d.id };
      if (d.lane.tenant !== null) fields.tenant = d.lane.tenant;
      rows.push([
        html`${d.fields.tenant ?? ""}`,
        jobLink(d.fields.job_id, d.fields.tenant),
        html`<span class="reason">${d.reason}</span>`,
        html`${d.deliveries}`,
        html`${d.dead_at}`,
        html`<span class="excerpt">${excerptOf(d.fields.payload)}</span>`,
        d.truncated.length || d.expired
          ? html`<span title="${
            d.truncated.length ? "payload truncated" : "older than 7 days"
          }: the client must resubmit">not replayable</span>`
          : actionButton(view, "/console/dead-letters/replay", "Replay", fields),
      ]);
    }
    if (rows.length >= PAGE_ROWS) break;
  }
  const body = html`<p>${total} dead letter(s)${total > rows.length ? ` (the oldest ${rows.length} shown)` : ""}.</p>
${total ? actionButton(view, "/console/dead-letters/replay", "Replay all", { all: "1" }) : ""}
${
    table(
      ["tenant", "job", "reason", "deliveries", "dead at", "document (start)", ""],
      rows,
      "The dead-letter streams are empty.",
    )
  }`;
  return page(view, "Dead letters", body, { note });
}

/** The outbox backlog and its failed rows, each with a Retry button. */
export async function outboxPage({ sql }: PageDeps, view: View, note?: string): Promise<Response> {
  const [backlog, failed] = await Promise.all([
    outboxBacklog(sql),
    listOutbox(sql, { failed: true, limit: PAGE_ROWS }),
  ]);
  const rows = failed.map((r) => [
    html`${r.id}`,
    html`${r.topic}`,
    html`<code>${r.dedupe_key}</code>`,
    html`${r.tenant ?? ""}`,
    html`<code>${r.destination ?? ""}</code>`,
    html`${r.attempts}`,
    html`<span class="reason">${r.last_error ?? ""}</span>`,
    actionButton(view, "/console/outbox/retry", "Retry", { id: r.id }),
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
    ${backlog.failed ? actionButton(view, "/console/outbox/retry", "Retry all failed", { all: "1" }) : ""}
    <h2>Failed rows</h2>${table(
      ["id", "topic", "dedupe key", "tenant", "destination", "attempts", "last error", ""],
      rows,
      "No failed rows.",
    )}
  `;
  return page(view, "Outbox", body, { note });
}

/** The shared limiter and breaker, as `deno task provider status` prints them. */
export async function providerPage({ providerStatus }: PageDeps, view: View): Promise<Response> {
  if (!providerStatus) {
    return page(
      view,
      "Provider",
      html`<p class="empty">No shared limiter or breaker: the model is the local extractive one.</p>`,
    );
  }
  return page(view, "Provider", html`<pre>${(await providerStatus()).join("\n")}</pre>`);
}

const ATTEMPT_COLUMNS = [
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
];

function attemptRow(a: JobAttempt): Html[] {
  return [
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
  ];
}

/** A run's task version: a link to its page (summarize, built in, has none), or that it is not known yet. */
function taskOfRun(tenant: string, run: { task: string; version: number } | undefined): Html {
  if (!run) return html`not known yet`;
  const label = `${run.task} v${run.version}`;
  return run.task === BUILT_IN_TASK ? html`${label}` : taskLink(tenant, run.task, run.version, label);
}

/**
 * One job (a run of `summarize`) or run of a task: its tenant, status and
 * task version, its notification and trace, its summary or its input and
 * output, and its model attempts.
 */
export async function jobPage(
  { redis, sql, keys }: PageDeps,
  view: View,
  jobId: string,
  tenant?: string,
): Promise<Response> {
  if (!JOB_ID.test(jobId)) return page(view, "Job", html`<p>Not a job id: <code>${jobId}</code></p>`, { status: 404 });
  const decided = await decidedRun(sql, jobId);
  let state: { tenant: string; status: string; error?: string; priority?: string } | undefined = decided
    ? { tenant: decided.tenant, status: decided.outcome, error: decided.error ?? undefined }
    : undefined;
  let run = decided ? { task: decided.task, version: decided.version } : undefined;
  if (!state) {
    // Undecided: its record in Redis, in its tenant's lane when the link names the tenant (else in each lane).
    const found = await readJobRecord(redis, keys, jobId, tenant);
    if (found) {
      state = {
        tenant: found.record.tenant!,
        status: found.record.status ?? "queued",
        error: found.record.error,
        priority: found.record.priority,
      };
      // Its task version as its record names it, or as its first recorded model attempt does.
      const { task, version } = found.record;
      run = task && /^\d+$/.test(version ?? "")
        ? { task, version: Number(version) }
        : await attemptedTaskOf(sql, jobId);
    }
  }
  if (!state) return page(view, "Job", html`<p>No job <code>${jobId}</code>.</p>`, { status: 404 });
  const [attempts, outbox] = await Promise.all([attemptsOf(sql, jobId), rowsOfJob(sql, jobId)]);
  const traceId = traceIdOf(outbox[0]?.traceparent ?? undefined);
  const isTask = run !== undefined && run.task !== BUILT_IN_TASK;
  const hasResult = decided !== undefined && decided.output !== null;
  const body = html`<dl class="figures"><dt>${isTask ? "run" : "job"}</dt><dd><code id="job-id">${jobId}</code></dd>
<dt>tenant</dt><dd>${state.tenant}</dd><dt>task</dt><dd id="job-task">${taskOfRun(state.tenant, run)}</dd>
<dt>status</dt><dd id="job-status">${state.status}</dd>
${
    state.priority
      ? html`
        <dt>priority</dt>
        <dd id="job-priority">${state.priority}</dd>
      `
      : ""
  }
${
    decided?.expires_at
      ? html`
        <dt>expired at</dt>
        <dd id="job-expires-at">${decided.expires_at.toISOString()}</dd>
      `
      : ""
  }
${
    state.error
      ? html`
        <dt>error</dt>
        <dd class="reason">${state.error}</dd>
      `
      : ""
  }
${
    hasResult
      ? html`
        <dt>model</dt>
        <dd>${decided.model ?? ""}</dd>
        <dt>cached</dt>
        <dd>${decided.cached ? "yes: no model call" : "no"}</dd>
      `
      : ""
  }
<dt>notification</dt><dd>${
    outbox[0] ? `${outbox[0].topic}: ${outbox[0].sent ? "sent" : outbox[0].failed ? "failed" : "pending"}` : "none yet"
  }</dd>
<dt>trace</dt><dd>${
    traceId ? html`<a href="#trace" id="trace-id" data-trace-id="${traceId}"><code>${traceId}</code></a>` : "not traced"
  }</dd></dl>
${
    decided?.summary
      ? html`
        <h2>Summary</h2>
        <pre class="summary">${decided.summary}</pre>
      `
      : ""
  }
${
    hasResult
      ? html`
        <h2>Input</h2>
        ${prettyJson(decided.input, "input")}
        <h2>Output</h2>
        ${typeof decided.output === "string"
          ? html`<pre class="output">${decided.output}</pre>`
          : prettyJson(decided.output, "output")}
      `
      : ""
  }
<h2>Model attempts</h2>${table(ATTEMPT_COLUMNS, attempts.map(attemptRow), "No model call yet.")}`;
  return page(view, isTask ? "Run" : "Job", body);
}
