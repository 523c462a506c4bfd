import type { Sql } from "postgres";
import type { Email } from "../mail/mailer.ts";
import type { PayloadLoader, Renderer } from "../outbox/relay.ts";
import { SUMMARY_READY_TOPIC } from "./commit.ts";

/**
 * The most characters of a summary an email carries. A summary is short,
 * but the extractive summary of a short document is the document itself, and
 * an email must never carry more than an excerpt of what a client sent.
 */
export const EMAIL_SUMMARY_MAX_CHARS = 2_000;

/** Renders outbox rows of the summary pipeline into emails from `from`. */
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
 * Loads the summaries that a batch of summary-ready rows reference, in one
 * query. Rows written before payloads became references keep their copy.
 */
export function summaryPayloadLoader(sql: Sql): PayloadLoader {
  return async (rows) => {
    const wanted = rows.filter((r) => r.topic === SUMMARY_READY_TOPIC && typeof r.payload.summary !== "string");
    if (wanted.length === 0) return;
    const found = await sql<{ job_id: string; summary: string }[]>`
      SELECT job_id::text, summary FROM summaries WHERE job_id = ANY(${
      wanted.map((r) => String(r.payload.job_id))
    }::uuid[])`;
    const byId = new Map(found.map((f) => [f.job_id, f.summary]));
    for (const row of wanted) {
      const summary = byId.get(String(row.payload.job_id));
      if (summary !== undefined) row.payload = { ...row.payload, summary };
    }
  };
}
