import type { Sql } from "postgres";

/** An outbox row as `outbox list` shows it. */
export interface OutboxListRow {
  id: string;
  dedupe_key: string;
  topic: string;
  attempts: number;
  state: "pending" | "sent" | "failed";
  next_attempt_at: Date;
  last_error: string | null;
  created_at: Date;
}

/** Lists unsent rows (or only failed ones), oldest first. */
export async function listOutbox(sql: Sql, { failed = false, limit = 1000 } = {}): Promise<OutboxListRow[]> {
  return await sql<OutboxListRow[]>`
    SELECT id::text, dedupe_key, topic, attempts, next_attempt_at, last_error, created_at,
      CASE WHEN sent_at IS NOT NULL THEN 'sent' WHEN failed_at IS NOT NULL THEN 'failed' ELSE 'pending' END AS state
    FROM outbox
    WHERE sent_at IS NULL AND (${!failed} OR failed_at IS NOT NULL)
    ORDER BY id LIMIT ${limit}`;
}

/**
 * Makes failed rows due again with a fresh attempt count. Only failed rows
 * are touched, so retrying a row that was meanwhile sent does nothing.
 * @returns how many rows were reset.
 */
export async function retryFailed(sql: Sql, ids: string[] | "all"): Promise<number> {
  const rows = ids === "all"
    ? await sql`
      UPDATE outbox SET failed_at = NULL, attempts = 0, next_attempt_at = now(), locked_until = NULL
      WHERE failed_at IS NOT NULL AND sent_at IS NULL RETURNING id`
    : await sql`
      UPDATE outbox SET failed_at = NULL, attempts = 0, next_attempt_at = now(), locked_until = NULL
      WHERE id = ANY(${ids}::bigint[]) AND failed_at IS NOT NULL AND sent_at IS NULL RETURNING id`;
  return rows.length;
}

/** Backlog figures for metrics and runbooks. */
export async function outboxBacklog(sql: Sql): Promise<{ unsent: number; failed: number; oldest_unsent_s: number }> {
  const [row] = await sql<{ unsent: number; failed: number; oldest_unsent_s: number }[]>`
    SELECT count(*) FILTER (WHERE failed_at IS NULL)::int AS unsent,
      count(*) FILTER (WHERE failed_at IS NOT NULL)::int AS failed,
      coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE failed_at IS NULL)), 0)::float8 AS oldest_unsent_s
    FROM outbox WHERE sent_at IS NULL`;
  return row!;
}
