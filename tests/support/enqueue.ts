/**
 * Enqueuing a job directly, without the API's idempotency record: what tests,
 * the bench and the chaos run use to fill a queue.
 */
import type { RedisClient } from "../../src/clients.ts";
import { defineScript } from "../../src/redis/script.ts";
import type { JobKeys, ServiceKeys } from "../../src/summaries/keys.ts";
import { announceLane } from "../../src/queue/lanes.ts";
import { markQueuedLua } from "../../src/summaries/job_status.ts";
import { JOB_RECORD_TTL_S } from "../../src/summaries/keys.ts";
import type { SummaryRequest } from "../../src/summaries/schemas.ts";

// One script, so one command and one round trip; both keys share the `{jobs}`
// hash tag, so it runs on a single Redis Cluster slot.
const ENQUEUE = defineScript(`
local id = redis.call('XADD', KEYS[1], '*', 'job_id', ARGV[1], 'tenant', ARGV[2], 'payload', ARGV[3])
${markQueuedLua({ key: "KEYS[2]", tenant: "ARGV[2]", ttl: "ARGV[4]" })}
return id`);

/**
 * Puts a job on the stream and records it as queued for `GET`, atomically
 * in one round trip. Enqueuing the same job id twice, as happens when the
 * API dies between XADD and finalising the idempotency record, is harmless:
 * the worker's summary primary key makes the second delivery a duplicate.
 * @returns the stream entry id.
 */
export async function enqueueJob(
  redis: RedisClient,
  keys: JobKeys,
  job: { jobId: string; tenant: string; request: SummaryRequest },
): Promise<string> {
  const id = await ENQUEUE.run(redis, [keys.stream, keys.job(job.jobId)], [
    job.jobId,
    job.tenant,
    JSON.stringify(job.request),
    JOB_RECORD_TTL_S,
  ]);
  return id as string;
}

/** Enqueues into the tenant's lane and announces the lane, as intake does. @returns the stream entry id. */
export async function enqueueToLane(
  redis: RedisClient,
  keys: ServiceKeys,
  job: { jobId: string; tenant: string; request: SummaryRequest },
): Promise<string> {
  const id = await enqueueJob(redis, keys.lane(job.tenant), job);
  await announceLane(redis, keys.registry, job.tenant);
  return id;
}
