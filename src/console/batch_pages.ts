/** The console's Batches page (issue 43): the provider batches in flight and the recent ones, as `batches list`. */
import { batchesInFlight, type BatchRow, listBatches } from "../batches/batch_store.ts";
import type { PageDeps } from "./_deps.ts";
import { html } from "./html.ts";
import { ago, page, PAGE_ROWS, table, type View } from "./layout.ts";

/** How long a committed batch stays on the page (as in `deno task batches list`). */
export const RECENT_BATCHES_MS = 24 * 3600_000;

const COLUMNS = [
  "id",
  "deployment",
  "model",
  "runs",
  "state",
  "provider batch",
  "provider status",
  "opened",
  "age",
  "ended",
  "committed",
];

/** A duration for people, in hours past two of them (a batch may take 24 h). */
function duration(ms: number): string {
  return ms < 2 * 3600_000 ? ago(ms) : `${(ms / 3600_000).toFixed(1)} h`;
}

/** A batch's row: its age runs from its opening to now, or, once committed, to its commit (how long it took). */
function batchRow(b: BatchRow, now: number) {
  const age = Math.max(0, (b.committed_at?.getTime() ?? now) - b.opened_at.getTime());
  return [
    html`<code>${b.id}</code>`,
    html`${b.deployment}`,
    html`${b.model}`,
    html`${b.runs}`,
    html`<span class="state">${b.state}</span>`,
    html`<code>${b.provider_batch_id ?? ""}</code>`,
    html`${b.provider_status ?? ""}`,
    html`${b.opened_at.toISOString()}`,
    html`${duration(age)}`,
    html`${b.ended_at?.toISOString() ?? ""}`,
    html`${b.committed_at?.toISOString() ?? ""}`,
  ];
}

/**
 * The batches in flight and those committed in the last 24 h, newest first (at most `PAGE_ROWS`), under the
 * figures the worker's metrics export (one aggregate over the batches in flight, whatever the rows listed): how
 * many are in flight, their runs not settled yet, and the oldest one's age. Without a batch deployment
 * (`batchDeployments` empty) it says so, and still lists what Postgres holds (batches of an earlier configuration).
 */
export async function batchesPage(
  { sql, now = Date.now, batchDeployments = [] }: PageDeps,
  view: View,
): Promise<Response> {
  const [rows, inFlight] = await Promise.all([
    listBatches(sql, { recentMs: RECENT_BATCHES_MS, limit: PAGE_ROWS }),
    batchesInFlight(sql),
  ]);
  const count = inFlight.reduce((n, r) => n + r.batches, 0);
  const waiting = inFlight.reduce((n, r) => n + r.runs_waiting, 0);
  const oldestS = inFlight.reduce((s, r) => Math.max(s, r.oldest_s), 0);
  const at = now();
  const body = html`
    ${batchDeployments.length === 0
      ? html`<p class="empty" id="no-batch-deployments">No deployment of <code>LLM_DEPLOYMENTS</code> is marked
        <code>"batch": true</code>: batch runs run online as <code>low</code>.</p>`
      : html`<p id="batch-deployments">Batch deployments: ${batchDeployments.join(", ")}.</p>`}
    <dl class="figures">
      <dt>in flight</dt>
      <dd id="batches-in-flight">${count}</dd>
      <dt>runs waiting in them</dt>
      <dd id="batch-runs-waiting">${waiting}</dd>
      <dt>oldest in flight</dt>
      <dd id="oldest-in-flight">${count ? duration(oldestS * 1000) : "none"}</dd>
    </dl>
    ${table(COLUMNS, rows.map((b) => batchRow(b, at)), "No batches in flight or committed in the last 24 h.")}
  `;
  return page(view, "Batches", body);
}
