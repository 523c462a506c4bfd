/**
 * The job-status hash (`keys.job(id)`: tenant, status, error) that
 * `GET /v1/summaries/{id}` reads before the summary exists. This module is
 * its only writer: every change is one of the operations below, each inside
 * the atomic step that causes it (the enqueue script, the dead-letter MULTI,
 * the replay script), except a cancel, which Postgres decides and this
 * records right after.
 */
import type { RedisClient } from "../clients.ts";
import type { DeadLetterHook, RecordUpdate } from "../queue/dead_letter.ts";
import { defineScript } from "../redis/script.ts";
import { JOB_RECORD_TTL_S, jobKeyBeside, type JobKeys, type ServiceKeys } from "./keys.ts";

/** What an enqueue script does to a job's record: fields to set, fields to delete, and its lifetime. */
export interface RecordChange {
  /** Field, value, field, value, ... (HSET). */
  set: string[];
  /** Fields to delete (HDEL). */
  del: string[];
  /** Seconds until the record expires (EXPIRE). */
  ttl_s: number;
}

/**
 * The enqueue script's change to the job's record: queued for `tenant`, no error, for `JOB_RECORD_TTL_S`; a
 * task run's record also names its task and version (a summary job's has neither: it runs summarize v1).
 */
export function markQueued(tenant: string, run?: { task: string; version: number }): RecordChange {
  const set = ["tenant", tenant, "status", "queued"];
  if (run) set.push("task", run.task, "version", String(run.version));
  return { set, del: ["error"], ttl_s: JOB_RECORD_TTL_S };
}

/** Marks the job failed with the dead-letter reason, inside the dead-letter MULTI (same hash tag as its lane). */
export const markFailedHook: DeadLetterHook = (multi, message, reason, lane) => {
  const jobId = message.fields.job_id;
  if (!jobId) return;
  const key = jobKeyBeside(lane.stream, jobId);
  multi.hset(key, "status", "failed", "error", reason.slice(0, 500)).expire(key, JOB_RECORD_TTL_S);
};

/** What a replay does to the job's record, inside the replay script: queued again, its error gone. */
export function markQueuedOnReplay(keys: JobKeys, jobId: string): RecordUpdate {
  return { key: keys.job(jobId), match: { field: "job_id", value: jobId }, set: ["status", "queued"], del: ["error"] };
}

const MARK_CANCELLED = defineScript(`
-- Mark cancelled: records a cancel Postgres decided in the job's record. Only an existing record changes: a
-- cancel never creates one for a job Redis no longer knows.
-- KEYS[1]  the job's record (hash)
-- Returns 1 when the record was changed, 0 when there was none.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'status', 'cancelled')
redis.call('HDEL', KEYS[1], 'error')
return 1`);

/** Records a cancel that Postgres decided (`cancelJob`) in the job's record at `key`. */
export async function markCancelled(redis: RedisClient, key: string): Promise<void> {
  await MARK_CANCELLED.run(redis, [key], []);
}

/** A job's status record (tenant, status, error) and the key it is under. */
export interface JobRecord {
  record: Record<string, string>;
  key: string;
}

/**
 * Finds a job's status record as `GET /v1/summaries/{id}` does: in its
 * tenant's lane; null when it does not name `tenant`. Without `tenant` (an
 * operator, who may see every tenant's jobs), each registered lane's in turn.
 */
export async function readJobRecord(
  redis: RedisClient,
  keys: ServiceKeys,
  jobId: string,
  tenant?: string,
): Promise<JobRecord | null> {
  const read = async (key: string) => ({ record: await redis.hgetall(key), key });
  if (tenant !== undefined) {
    const found = await read(keys.lane(tenant).job(jobId));
    return found.record.tenant === tenant ? found : null;
  }
  for (const lane of (await redis.smembers(keys.registry.all)).sort()) {
    const found = await read(keys.lane(lane).job(jobId));
    if (found.record.tenant) return found;
  }
  return null;
}
