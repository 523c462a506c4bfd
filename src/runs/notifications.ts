/**
 * What the relay needs to deliver the pipeline's notifications: summary and
 * run emails rendered, summary and run webhooks signed and sent, and the
 * results they carry loaded for a whole batch. A summary job's email and the
 * summaries it carries are the summary API's (`summaries/email.ts`): the
 * process passes them in.
 */
import type { Sql } from "postgres";
import type { OutboxSender, PayloadLoader, Renderer } from "../outbox/relay.ts";
import type { ResolveHost, WebhookUrlPolicy } from "../webhooks/addresses.ts";
import { RUN_WEBHOOK_TOPIC, SUMMARY_WEBHOOK_TOPIC } from "./shapes.ts";
import { runEmailRenderer, runPayloadLoader } from "./email.ts";
import { summaryWebhooks } from "./webhook.ts";

/** The relay's renderer, senders and loader for the pipeline's outbox topics. */
export function pipelineNotifications(
  { sql, from, policy, timeoutMs, resolve, caCerts, summaries }: {
    sql: Sql;
    /** MAIL_FROM. */
    from: string;
    policy: WebhookUrlPolicy;
    /** Caps one webhook delivery (MAIL_SEND_TIMEOUT_S). */
    timeoutMs: number;
    resolve?: ResolveHost;
    caCerts?: string[];
    /** Renders every email but a run's, and loads the summaries of a batch (`summaries/email.ts`). */
    summaries: { render: Renderer; load: PayloadLoader };
  },
): { render: Renderer; senders: Record<string, OutboxSender>; load: PayloadLoader } {
  const webhooks = summaryWebhooks({ sql, policy, timeoutMs, resolve, caCerts });
  const outputs = runPayloadLoader(sql);
  return {
    render: runEmailRenderer(from, summaries.render),
    senders: { [SUMMARY_WEBHOOK_TOPIC]: webhooks.send, [RUN_WEBHOOK_TOPIC]: webhooks.send },
    load: async (rows) => {
      await summaries.load(rows);
      await outputs(rows);
      await webhooks.load(rows);
    },
  };
}
