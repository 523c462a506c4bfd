/**
 * The console's Postgres reads, one function each. (Their SQL is due to move
 * behind the job store; until then it lives here, apart from the pages.)
 */
import type { Sql } from "postgres";
import type { AttemptRow } from "../summaries/attempt_log.ts";

/** Jobs done in the last minute, by tenant. */
export async function donePerMinute(sql: Sql): Promise<Map<string, number>> {
  return new Map(
    (await sql<{ tenant: string; n: number }[]>`
        SELECT tenant, count(*)::int AS n FROM job_outcomes
        WHERE outcome = 'done' AND decided_at > now() - interval '1 minute' GROUP BY tenant`).map((
      r,
    ) => [r.tenant, r.n]),
  );
}

/** A decided job: its tenant, outcome and summary (if any). */
export interface DecidedJob {
  tenant: string;
  outcome: string;
  decided_at: Date;
  summary: string | null;
}

/** The job's outcome as Postgres decided it; undefined while it is undecided. */
export async function decidedJob(sql: Sql, jobId: string): Promise<DecidedJob | undefined> {
  const [decided] = await sql<DecidedJob[]>`
      SELECT o.tenant, o.outcome, o.decided_at, s.summary
      FROM job_outcomes o LEFT JOIN summaries s USING (job_id) WHERE o.job_id = ${jobId}`;
  return decided;
}

/** A model attempt of a job, as the job page lists it. */
export type JobAttempt = Omit<AttemptRow, "job_id" | "tenant">;

/** The job's model attempts, oldest first. */
export async function jobAttempts(sql: Sql, jobId: string): Promise<JobAttempt[]> {
  return await sql<
    Omit<AttemptRow, "job_id" | "tenant">[]
  >`SELECT delivery, attempt, started_at, duration_ms, outcome, status, prompt_tokens, completion_tokens,
          provider_request_id, model, error
        FROM model_attempts WHERE job_id = ${jobId} ORDER BY started_at`;
}

/** An outbox row of a job: its topic, trace and whether it went out. */
export interface JobNotification {
  topic: string;
  traceparent: string | null;
  sent: boolean;
  failed: boolean;
}

/** The job's outbox rows (its notification). */
export async function jobNotifications(sql: Sql, jobId: string): Promise<JobNotification[]> {
  return await sql<{ topic: string; traceparent: string | null; sent: boolean; failed: boolean }[]>`
        SELECT topic, payload->>'traceparent' AS traceparent, sent_at IS NOT NULL AS sent, failed_at IS NOT NULL AS failed
        FROM outbox WHERE payload->>'job_id' = ${jobId}`;
}
