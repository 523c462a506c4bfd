/**
 * A finished run's email (`email.run_finished`), and the outputs that run
 * notifications (emails and webhooks) carry, loaded for a whole batch. A
 * summary job's email is the summary API's (`summaries/email.ts`).
 */
import type { Sql } from "postgres";
import type { Email } from "../mail/mailer.ts";
import { runOutputsOf } from "../jobs/job_store.ts";
import type { PayloadLoader, Renderer } from "../outbox/relay.ts";
import { RUN_EMAIL_TOPIC, RUN_WEBHOOK_TOPIC } from "./shapes.ts";

/** The most characters of a run's output (pretty-printed) an email carries; the whole is at `/v1/runs/{id}`. */
export const EMAIL_OUTPUT_MAX_CHARS = 20_000;

/** A finished run's email: its output pretty-printed (a text output as it is), why it failed, or that it expired. */
function runEmail(from: string, payload: Record<string, unknown>): Email {
  const { job_id, to, task, version, status, error } = payload as {
    job_id?: string;
    to?: string;
    task?: string;
    version?: number;
    status?: string;
    error?: string;
  };
  if (!job_id || !to || !task || (status === "done" && !("output" in payload))) {
    throw new TypeError(`Outbox payload for ${RUN_EMAIL_TOPIC} lacks job_id, to, task or output`);
  }
  const where = `You can also fetch it with GET /v1/runs/${job_id}.
`;
  if (status === "expired") {
    return {
      from,
      to: [to],
      subject: `Your run of ${task} expired (run ${job_id})`,
      text: `Run ${job_id} of ${task} (version ${version}) expired: its model call had not started within the \
expires_in it was given, so it ended without an output.

${where}`,
    };
  }
  if (status !== "done") {
    return {
      from,
      to: [to],
      subject: `Your run of ${task} failed (run ${job_id})`,
      text: `Run ${job_id} of ${task} (version ${version}) failed: ${error ?? "failed"}.

${where}`,
    };
  }
  const output = typeof payload.output === "string" ? payload.output : JSON.stringify(payload.output, null, 2);
  const shown = output.length > EMAIL_OUTPUT_MAX_CHARS
    ? `${output.slice(0, EMAIL_OUTPUT_MAX_CHARS)}…

(The whole output is at the address below.)`
    : output;
  return {
    from,
    to: [to],
    subject: `Your run of ${task} is done (run ${job_id})`,
    text: `Run ${job_id} of ${task} (version ${version}) is done. Here is the output:

${shown}

${where}`,
  };
}

/** Renders a run's email from `from`, and hands every other topic to `others` (the summary jobs' renderer). */
export function runEmailRenderer(from: string, others: Renderer): Renderer {
  return (topic, payload): Email => topic === RUN_EMAIL_TOPIC ? runEmail(from, payload) : others(topic, payload);
}

/**
 * Loads the outputs that a batch of done runs' rows (emails and webhooks)
 * reference, in one query; a failed run's notification carries its error
 * instead.
 */
export function runPayloadLoader(sql: Sql): PayloadLoader {
  const runTopics = new Set([RUN_EMAIL_TOPIC, RUN_WEBHOOK_TOPIC]);
  return async (rows) => {
    const runs = rows.filter((r) => runTopics.has(r.topic) && r.payload.status === "done");
    if (runs.length > 0) {
      const byId = await runOutputsOf(sql, runs.map((r) => String(r.payload.job_id)));
      for (const row of runs) {
        const id = String(row.payload.job_id);
        if (byId.has(id)) row.payload = { ...row.payload, output: byId.get(id) };
      }
    }
  };
}
