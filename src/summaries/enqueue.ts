import type { Redis } from "ioredis";
import type { JobKeys } from "./keys.ts";
import { JOB_RECORD_TTL_S } from "./keys.ts";
import type { SummaryRequest } from "./schemas.ts";

/** A summary job as it travels on the stream. */
export interface JobFields {
  job_id: string;
  tenant: string;
  payload: string;
}

/**
 * Puts a job on the stream and records it as queued, in one MULTI round
 * trip (both keys share the `{jobs}` hash tag). Enqueuing the same job id
 * twice, as happens when the API dies between XADD and finalising the
 * idempotency record, is harmless: the worker's summary primary key makes
 * the second delivery a duplicate.
 * @returns the stream entry id.
 */
export async function enqueueJob(
  redis: Redis,
  keys: JobKeys,
  job: { jobId: string; tenant: string; request: SummaryRequest },
): Promise<string> {
  const record = keys.job(job.jobId);
  const results = await redis.multi()
    .xadd(keys.stream, "*", "job_id", job.jobId, "tenant", job.tenant, "payload", JSON.stringify(job.request))
    .hset(record, "tenant", job.tenant, "status", "queued")
    .hdel(record, "error")
    .expire(record, JOB_RECORD_TTL_S)
    .exec();
  if (!results) throw new Error("Enqueue transaction was aborted");
  for (const [error] of results) if (error) throw error;
  return results[0]![1] as string;
}
