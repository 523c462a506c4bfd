/**
 * Webhook delivery of finished summaries: the `webhook.summary_ready`
 * outbox topic, sent by the relay as a Standard Webhook signed with the
 * tenant's secret(s). The outbox row references the summary and the
 * tenant; both are loaded for a whole batch in two queries.
 */
import type { Sql } from "postgres";
import type { OutboxRow, OutboxSender, PayloadLoader } from "../outbox/relay.ts";
import { signingSecrets } from "../tenants/webhook_secrets.ts";
import { type ResolveHost, WebhookRefused, type WebhookUrlPolicy } from "../webhooks/addresses.ts";
import { sendWebhook } from "../webhooks/http_post.ts";
import { RUN_WEBHOOK_TOPIC, SUMMARY_WEBHOOK_TOPIC } from "./shapes.ts";
import type { RunWebhook, SummaryWebhook } from "./shapes.ts";

/** Loads what a batch's webhook rows need, and sends them. */
export function summaryWebhooks(
  { sql, policy, timeoutMs, resolve, caCerts }: {
    sql: Sql;
    policy: WebhookUrlPolicy;
    /** Caps one delivery: DNS, connect, TLS and the receiver's answer (MAIL_SEND_TIMEOUT_S). */
    timeoutMs: number;
    resolve?: ResolveHost;
    caCerts?: string[];
  },
): { load: PayloadLoader; send: OutboxSender } {
  // Secrets stay out of the row's payload (which error paths may describe): they live here, per claimed row.
  const secrets = new WeakMap<OutboxRow, string[]>();
  return {
    async load(rows) {
      const webhooks = rows.filter((r) => r.topic === SUMMARY_WEBHOOK_TOPIC || r.topic === RUN_WEBHOOK_TOPIC);
      if (webhooks.length === 0) return;
      const byTenant = await signingSecrets(sql, [...new Set(webhooks.map((r) => String(r.payload.tenant)))]);
      for (const row of webhooks) {
        const found = byTenant.get(String(row.payload.tenant));
        if (found) secrets.set(row, found);
      }
    },
    async send(row, signal) {
      const { job_id, webhook } = row.payload as { job_id?: string; webhook?: string };
      if (!job_id || !webhook) throw new WebhookRefused(`outbox row ${row.id} lacks its job id or webhook URL`);
      const body = row.topic === RUN_WEBHOOK_TOPIC ? runWebhookBody(row) : summaryWebhookBody(row);
      const keys = secrets.get(row);
      if (!keys) throw new WebhookRefused(`tenant ${String(row.payload.tenant)} has no webhook signing secret`);
      await sendWebhook({
        url: webhook,
        policy,
        secrets: keys,
        id: row.dedupe_key,
        body: JSON.stringify(body),
        timeoutMs,
        signal,
        resolve,
        caCerts,
      });
      return {};
    },
  };
}

function summaryWebhookBody(row: OutboxRow): SummaryWebhook {
  const { job_id, summary } = row.payload as { job_id: string; summary?: string };
  if (typeof summary !== "string") throw new WebhookRefused(`outbox row ${row.id} lacks its summary`);
  return { type: "summary.ready", job_id, status: "done", summary };
}

/** `run.completed` with the output, `run.failed` with the error, or `run.expired` with neither. */
function runWebhookBody(row: OutboxRow): RunWebhook {
  const { job_id, task, version, status, error } = row.payload as {
    job_id: string;
    task?: string;
    version?: number;
    status?: string;
    error?: string;
  };
  if (typeof task !== "string" || typeof version !== "number") {
    throw new WebhookRefused(`outbox row ${row.id} lacks its task or version`);
  }
  if (status === "expired") return { type: "run.expired", run_id: job_id, task, version, status: "expired" };
  if (status !== "done") return { type: "run.failed", run_id: job_id, task, version, status: "failed", error };
  if (!("output" in row.payload)) {
    throw new WebhookRefused(`outbox row ${row.id}'s run has no output (past retention?)`);
  }
  return { type: "run.completed", run_id: job_id, task, version, status: "done", output: row.payload.output };
}
