import type { Email } from "../mail/mailer.ts";
import type { Renderer } from "../outbox/relay.ts";
import { SUMMARY_READY_TOPIC } from "./commit.ts";

/** Renders outbox rows of the summary pipeline into emails from `from`. */
export function summaryEmailRenderer(from: string): Renderer {
  return (topic, payload): Email => {
    if (topic !== SUMMARY_READY_TOPIC) throw new TypeError(`No email template for outbox topic "${topic}"`);
    const { job_id, to, summary } = payload as { job_id?: string; to?: string; summary?: string };
    if (!job_id || !to || typeof summary !== "string") {
      throw new TypeError(`Outbox payload for ${topic} lacks job_id, to or summary`);
    }
    return {
      from,
      to: [to],
      subject: `Your summary is ready (job ${job_id})`,
      text: `Job ${job_id} is done. Here is the summary:\n\n${summary}\n\n` +
        `You can also fetch it with GET /v1/summaries/${job_id}.\n`,
    };
  };
}
