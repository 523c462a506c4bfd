import type { Sql } from "postgres";
import type { Email } from "../mail/mailer.ts";
import { summariesOf } from "../jobs/job_store.ts";
import { sentLastHour } from "../outbox/outbox_store.ts";
import type { Deferral, PayloadLoader, Renderer } from "../outbox/relay.ts";
import { RUN_EMAIL_TOPIC, RUN_WEBHOOK_TOPIC, SUMMARY_READY_TOPIC, SUMMARY_WEBHOOK_TOPIC } from "../runs/shapes.ts";

/**
 * The most characters of a summary an email carries. A summary is short,
 * but the extractive summary of a short document is the document itself, and
 * an email must never carry more than an excerpt of what a client sent.
 */
export const EMAIL_SUMMARY_MAX_CHARS = 2_000;

/** Renders a summary job's email (`email.summary_ready`) from `from`; a run's is `runs/email.ts`'s. */
export function summaryEmailRenderer(from: string): Renderer {
  return (topic, payload): Email => {
    if (topic !== SUMMARY_READY_TOPIC) throw new TypeError(`No email template for outbox topic "${topic}"`);
    const { job_id, to, summary } = payload as { job_id?: string; to?: string; summary?: string };
    if (!job_id || !to || typeof summary !== "string") {
      throw new TypeError(`Outbox payload for ${topic} lacks job_id, to or summary`);
    }
    const excerpt = summary.length > EMAIL_SUMMARY_MAX_CHARS
      ? `${summary.slice(0, EMAIL_SUMMARY_MAX_CHARS).trimEnd()}…\n\n(The whole summary is at the address below.)`
      : summary;
    return {
      from,
      to: [to],
      subject: `Your summary is ready (job ${job_id})`,
      text: `Job ${job_id} is done. Here is the summary:\n\n${excerpt}\n\n` +
        `You can also fetch it with GET /v1/summaries/${job_id}.\n`,
    };
  };
}

/**
 * Loads the summaries that a batch of summary-ready rows (emails and
 * webhooks) reference, in one query. Rows written before payloads became
 * references keep their copy.
 */
export function summaryPayloadLoader(sql: Sql): PayloadLoader {
  const topics = new Set([SUMMARY_READY_TOPIC, SUMMARY_WEBHOOK_TOPIC]);
  return async (rows) => {
    const wanted = rows.filter((r) => topics.has(r.topic) && typeof r.payload.summary !== "string");
    if (wanted.length > 0) {
      const byId = await summariesOf(sql, wanted.map((r) => String(r.payload.job_id)));
      for (const row of wanted) {
        const summary = byId.get(String(row.payload.job_id));
        if (summary !== undefined) row.payload = { ...row.payload, summary };
      }
    }
  };
}

/**
 * MAIL_TENANT_HOURLY_LIMIT and WEBHOOK_TENANT_HOURLY_LIMIT: at most so many
 * emails, and so many webhooks, per tenant in any hour (`limits` by outbox
 * topic; a topic without one is not capped). Rows over it wait in the
 * outbox (a minute at a time) without spending an attempt. Rows other
 * relays hold right now count as sent, so relays running side by side err
 * on the side of sending fewer, never more.
 */
export function tenantHourlyLimits(sql: Sql, limits: Partial<Record<string, number>>): Deferral {
  // A run's email counts against the same limit as a summary's, and its webhook as a summary's webhook.
  const together: Record<string, string[]> = {
    [SUMMARY_READY_TOPIC]: [SUMMARY_READY_TOPIC, RUN_EMAIL_TOPIC],
    [SUMMARY_WEBHOOK_TOPIC]: [SUMMARY_WEBHOOK_TOPIC, RUN_WEBHOOK_TOPIC],
  };
  return async (claimed) => {
    const waits = new Map<string, number>();
    const mine = claimed[0]?.claim_token;
    if (!mine) return waits;
    for (const [topic, limit] of Object.entries(limits)) {
      if (limit === undefined) continue;
      const topics = together[topic] ?? [topic];
      const rows = claimed.filter((r) => topics.includes(r.topic));
      const tenants = [...new Set(rows.map((r) => String(r.payload.tenant ?? "")))];
      if (tenants.length === 0) continue;
      const counts = await sentLastHour(sql, { tenants, topics, claimToken: mine });
      const used = new Map(counts.map((c) => [c.tenant, c.n]));
      for (const row of rows) {
        const tenant = String(row.payload.tenant ?? "");
        const n = used.get(tenant) ?? 0;
        if (n >= limit) waits.set(row.id, 60_000);
        else used.set(tenant, n + 1);
      }
    }
    return waits;
  };
}

/** MAIL_TENANT_HOURLY_LIMIT alone: {@linkcode tenantHourlyLimits} for emails. */
export function tenantHourlyLimit(sql: Sql, limit: number): Deferral {
  return tenantHourlyLimits(sql, { [SUMMARY_READY_TOPIC]: limit });
}
