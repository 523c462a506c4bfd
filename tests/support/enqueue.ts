/**
 * Enqueuing a job directly, without the API's idempotency record: what tests,
 * the bench and the chaos run use to fill a queue.
 */
import type { RedisClient } from "../../src/clients.ts";
import { defineScript } from "../../src/redis/script.ts";
import type { LaneKeys, Priority, ServiceKeys } from "../../src/runs/keys.ts";
import { announceLane } from "../../src/queue/lanes.ts";
import { markQueued } from "../../src/runs/job_status.ts";
import type { SummaryRequest } from "../../src/runs/shapes.ts";
import type { RunPayload } from "../../src/runs/run_payload.ts";

// ENQUEUE: puts a job on a stream and records it as queued, in one command.
// KEYS[1]  the stream.
// KEYS[2]  the job's status record (same hash tag as the stream, so one Redis Cluster slot).
// ARGV[1]  the job id.
// ARGV[2]  the tenant.
// ARGV[3]  the payload.
// ARGV[4]  JSON: the status record's change (`markQueued`).
// Returns the stream entry id.
const ENQUEUE = defineScript(`
local id = redis.call('XADD', KEYS[1], '*', 'job_id', ARGV[1], 'tenant', ARGV[2], 'payload', ARGV[3])
local status = cjson.decode(ARGV[4])
redis.call('HSET', KEYS[2], unpack(status.set))
redis.call('HDEL', KEYS[2], unpack(status.del))
if status.ttl_s > 0 then redis.call('EXPIRE', KEYS[2], status.ttl_s) end
return id`);

/**
 * Puts a job on the stream (a lane's intake stream, or the pre-lane stream of the legacy drain's tests) and records
 * it as queued for `GET`, atomically
 * in one round trip. Enqueuing the same job id twice, as happens when the
 * API dies between XADD and finalising the idempotency record, is harmless:
 * the worker's summary primary key makes the second delivery a duplicate.
 * @returns the stream entry id.
 */
export async function enqueueJob(
  redis: RedisClient,
  keys: Pick<LaneKeys, "stream" | "job">,
  job: { jobId: string; tenant: string; request: SummaryRequest },
): Promise<string> {
  const id = await ENQUEUE.run(redis, [keys.stream, keys.job(job.jobId)], [
    job.jobId,
    job.tenant,
    JSON.stringify(job.request),
    JSON.stringify(markQueued(job.tenant)),
  ]);
  return id as string;
}

/**
 * Enqueues a run of a task into the tenant's lane, as `POST /v1/tasks/{name}/runs` does after validating its
 * input (the payload names the version, which must exist for the worker), and announces the lane (unless
 * `announce` is false: a bench queues a backlog first, then announces it once), on its `priority`'s stream.
 * @returns the stream entry id.
 */
export async function enqueueRunToLane(
  redis: RedisClient,
  keys: ServiceKeys,
  job: { jobId: string; tenant: string; run: RunPayload },
  { announce = true, priority }: { announce?: boolean; priority?: Priority } = {},
): Promise<string> {
  const lane = keys.lane(job.tenant);
  const id = await ENQUEUE.run(redis, [lane.streamOf(priority), lane.job(job.jobId)], [
    job.jobId,
    job.tenant,
    JSON.stringify(job.run),
    JSON.stringify(markQueued(job.tenant, job.run)),
  ]);
  if (announce) await announceLane(redis, keys.registry, job.tenant);
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
