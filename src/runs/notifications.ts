/**
 * What the relay needs to deliver the pipeline's notifications: summary and
 * run emails rendered, summary and run webhooks signed and sent, and the
 * results they carry loaded for a whole batch.
 */
import type { Sql } from "postgres";
import type { OutboxSender, PayloadLoader, Renderer } from "../outbox/relay.ts";
import type { ResolveHost, WebhookUrlPolicy } from "../webhooks/addresses.ts";
import { RUN_WEBHOOK_TOPIC, SUMMARY_WEBHOOK_TOPIC } from "./commit.ts";
import { summaryEmailRenderer, summaryPayloadLoader } from "../summaries/email.ts";
import { summaryWebhooks } from "./webhook.ts";

/** The relay's renderer, senders and loader for the pipeline's outbox topics. */
export function pipelineNotifications(
  { sql, from, policy, timeoutMs, resolve, caCerts }: {
    sql: Sql;
    /** MAIL_FROM. */
    from: string;
    policy: WebhookUrlPolicy;
    /** Caps one webhook delivery (MAIL_SEND_TIMEOUT_S). */
    timeoutMs: number;
    resolve?: ResolveHost;
    caCerts?: string[];
  },
): { render: Renderer; senders: Record<string, OutboxSender>; load: PayloadLoader } {
  const webhooks = summaryWebhooks({ sql, policy, timeoutMs, resolve, caCerts });
  const results = summaryPayloadLoader(sql);
  return {
    render: summaryEmailRenderer(from),
    senders: { [SUMMARY_WEBHOOK_TOPIC]: webhooks.send, [RUN_WEBHOOK_TOPIC]: webhooks.send },
    load: async (rows) => {
      await results(rows);
      await webhooks.load(rows);
    },
  };
}
