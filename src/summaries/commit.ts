import type { Sql } from "postgres";
import type { Logger } from "../log/logger.ts";

/** A finished summary ready to commit, with what its notification email needs. */
export interface SummaryResult {
  jobId: string;
  tenant: string;
  summary: string;
  notify: string;
}

/** The outbox topic and dedupe key of a summary's notification. */
export const SUMMARY_READY_TOPIC = "email.summary_ready";
export const dedupeKeyFor = (jobId: string) => `summary_ready:${jobId}`;

/**
 * Commits summaries and their outbox rows in one statement (so one
 * transaction). `INSERT ... ON CONFLICT (job_id) DO NOTHING RETURNING job_id`
 * is the exactly-once guard: when two deliveries of a job race, both paid for
 * the model, but only the one whose row was inserted writes an outbox row,
 * because outbox rows are written for exactly the returned ids.
 * @returns the job ids this call inserted; the others were already committed.
 */
export async function commitSummaries(sql: Sql, results: SummaryResult[]): Promise<Set<string>> {
  if (results.length === 0) return new Set();
  const payloads = results.map((r) =>
    JSON.stringify({ job_id: r.jobId, tenant: r.tenant, to: r.notify, summary: r.summary })
  );
  const rows = await sql<{ job_id: string }[]>`
    WITH input AS (
      SELECT * FROM unnest(
        ${results.map((r) => r.jobId)}::uuid[],
        ${results.map((r) => r.tenant)}::text[],
        ${results.map((r) => r.summary)}::text[],
        ${payloads}::text[]
      ) AS t(job_id, tenant, summary, payload)
    ), inserted AS (
      INSERT INTO summaries (job_id, tenant, summary)
      SELECT job_id, tenant, summary FROM input
      ON CONFLICT (job_id) DO NOTHING
      RETURNING job_id
    ), outbox_rows AS (
      INSERT INTO outbox (topic, dedupe_key, payload)
      SELECT ${SUMMARY_READY_TOPIC}, 'summary_ready:' || input.job_id, input.payload::jsonb
      FROM input JOIN inserted USING (job_id)
      ON CONFLICT (dedupe_key) DO NOTHING
    )
    SELECT job_id::text FROM inserted`;
  return new Set(rows.map((r) => r.job_id));
}

/** Commits one summary at a time as jobs finish, grouping those that finish together. */
export interface GroupCommitter {
  /** @returns "done" if this call committed the job, "duplicate" if it was already committed. */
  commit(result: SummaryResult): Promise<"done" | "duplicate">;
}

interface Waiter {
  result: SummaryResult;
  resolve(outcome: "done" | "duplicate"): void;
  reject(error: unknown): void;
}

/**
 * Group commit without added latency: the first job commits at once; jobs
 * that finish while that transaction is in flight are committed together in
 * the next one (up to `maxBatch`). Each job keeps its own exactly-once guard.
 * If a batch fails, its jobs fall back to one transaction each, so one bad
 * row fails only its own job.
 */
export function createGroupCommitter(
  { sql, log }: { sql: Sql; log: Logger },
  options: { maxBatch?: number; inFlight?: number } = {},
): GroupCommitter {
  const maxBatch = options.maxBatch ?? 500;
  const maxInFlight = options.inFlight ?? 2;
  let queue: Waiter[] = [];
  let running = 0;

  async function flush(batch: Waiter[]): Promise<void> {
    // Two deliveries of one job in the same batch: the first decides, the others follow it.
    const first = new Map<string, Waiter>();
    const followers: Waiter[] = [];
    for (const w of batch) {
      if (first.has(w.result.jobId)) followers.push(w);
      else first.set(w.result.jobId, w);
    }
    for (const f of followers) {
      const leader = first.get(f.result.jobId)!;
      const { resolve, reject } = leader;
      leader.resolve = (outcome) => {
        resolve(outcome);
        f.resolve("duplicate");
      };
      leader.reject = (error) => {
        reject(error);
        f.reject(error);
      };
    }
    const unique = [...first.values()];
    try {
      const inserted = await commitSummaries(sql, unique.map((w) => w.result));
      for (const w of unique) w.resolve(inserted.has(w.result.jobId) ? "done" : "duplicate");
    } catch (error) {
      if (unique.length === 1) {
        unique[0]!.reject(error);
      } else {
        log.warn("group_commit_failed", { jobs: unique.length, error });
        await Promise.all(unique.map(async (w) => {
          try {
            const inserted = await commitSummaries(sql, [w.result]);
            w.resolve(inserted.has(w.result.jobId) ? "done" : "duplicate");
          } catch (e) {
            w.reject(e);
          }
        }));
      }
    }
  }

  function pump() {
    while (running < maxInFlight && queue.length > 0) {
      const batch = queue.slice(0, maxBatch);
      queue = queue.slice(maxBatch);
      running++;
      flush(batch).finally(() => {
        running--;
        pump();
      });
    }
  }

  return {
    commit(result) {
      return new Promise((resolve, reject) => {
        queue.push({ result, resolve, reject });
        pump();
      });
    },
  };
}
