/**
 * The job-status hash (`keys.job(id)`: tenant, status, error) that
 * `GET /v1/summaries/{id}` reads before the summary exists. This module is
 * its only writer: every change is one of the operations below, each inside
 * the atomic step that causes it (the enqueue script, the dead-letter script,
 * the replay script), except a cancel, which Postgres decides and this
 * records right after, and a run's start decision (`started`: when its first
 * model attempt was let go out, or `expired`; see {@linkcode decideStart}).
 * A record without `status` is a queued job's: intake writes none (issue 39:
 * 16 bytes of every queued job), and every reader, this release's and the one
 * before's, reads a missing status as `queued`.
 */
import type { RedisClient } from "../clients.ts";
import { notReplicated, type ReplicaAck } from "../redis/replica_ack.ts";
import type { DeadLetterHook, RecordUpdate } from "../queue/dead_letter.ts";
import type { QueueNames, StreamMessage } from "../queue/message.ts";
import { MARK_CANCELLED_SCRIPT } from "./mark_cancelled_script.ts";
import { MARK_STARTED_SCRIPT } from "./mark_started_script.ts";
import { JOB_RECORD_TTL_S, jobKeyBeside, type LaneKeys, type ServiceKeys } from "./keys.ts";

/** What an enqueue script does to a job's record: fields to set, fields to delete, and its lifetime. */
export interface RecordChange {
  /** Field, value, field, value, ... (HSET). */
  set: string[];
  /** Fields to delete (HDEL). */
  del: string[];
  /** Seconds until the record expires (EXPIRE); 0: it does not. */
  ttl_s: number;
}

/**
 * The enqueue script's change to the job's record: `tenant`'s, queued (no status field: see above), no error, and
 * no expiry: a queued run is visible and cancellable for as long as it waits (a month's budget, a provider's
 * outage), and a re-POST of its key is a replay however long ago the key's own record expired. Its lifetime starts
 * when its message leaves its lane (see {@linkcode recordExpiryOnAck}, and the dead letter's mark). A task run's
 * record also names its task and version (a summary job's has neither: it runs summarize v1), and its priority
 * unless normal.
 */
export function markQueued(
  tenant: string,
  run?: { task: string; version: number; priority?: string },
): RecordChange {
  const set = ["tenant", tenant];
  if (run) set.push("task", run.task, "version", String(run.version));
  // A run's priority other than normal, for the console while it waits (its lane's stream says it too).
  if (run?.priority) set.push("priority", run.priority);
  return { set, del: ["error"], ttl_s: 0 };
}

/**
 * The record's lifetime once its message is acknowledged (the job is done, cancelled, or found decided): from
 * then on `GET` reads the outcome from Postgres, and the record is kept `ttlS` for the worker's own checks.
 */
export function recordExpiryOnAck(
  ttlS = JOB_RECORD_TTL_S,
): (stream: QueueNames, message: StreamMessage) => { key: string; ttlS: number } | undefined {
  return (stream, message) => {
    const jobId = message.fields.job_id;
    return jobId ? { key: jobKeyBeside(stream.stream, jobId), ttlS } : undefined;
  };
}

/** Marks the job failed with the dead-letter reason, inside the dead-letter script (same hash tag as its lane). */
export const markFailedHook: DeadLetterHook = (message, reason, lane) => {
  const jobId = message.fields.job_id;
  if (!jobId) return undefined;
  const key = jobKeyBeside(lane.stream, jobId);
  return { key, set: ["status", "failed", "error", reason.slice(0, 500)], ttl_s: JOB_RECORD_TTL_S };
};

/**
 * What a replay does to the job's record, inside the replay script: queued again, its error gone, and no expiry
 * while it waits again (see {@linkcode markQueued}).
 */
export function markQueuedOnReplay(keys: Pick<LaneKeys, "job">, jobId: string): RecordUpdate {
  return {
    key: keys.job(jobId),
    match: { field: "job_id", value: jobId },
    set: ["status", "queued"],
    del: ["error"],
    persist: true,
  };
}

/** Records a cancel that Postgres decided (`cancelJob`) in the job's record at `key`. */
export async function markCancelled(redis: RedisClient, key: string): Promise<void> {
  await MARK_CANCELLED_SCRIPT.run(redis, [key], []);
}

/** A run's start decision in its job's record: when its first attempt was let go out (epoch ms), or `expired`. */
export type StartDecision = number | "expired";

/**
 * Decides, once, whether the run whose job record is at `key` (a run with an expiry, issue 41) starts its model
 * call (`start`: asked just before its first attempt goes out; granted only before `expiresAtMs` by Redis's clock)
 * or expired (`expire`: asked before it is decided expired). The first decision stands, in any delivery; this
 * answers it. With `ack` (REDIS_MIN_REPLICAS_ACK), it resolves only once the replicas have it, so a promotion keeps
 * it (the script writes the decision again each time, so the WAIT covers one made on another connection).
 * @throws {NotReplicated} when fewer replicas acknowledged it in time (the caller must not act on it).
 */
export async function decideStart(
  redis: RedisClient,
  key: string,
  mode: "start" | "expire",
  expiresAtMs: number,
  ack?: ReplicaAck,
): Promise<StartDecision> {
  const args = [mode, Math.floor(expiresAtMs), JOB_RECORD_TTL_S];
  let decided: unknown;
  if (!ack) decided = await MARK_STARTED_SCRIPT.run(redis, [key], args);
  else {
    const { result, acked, replicated } = await ack.run(MARK_STARTED_SCRIPT, [key], args);
    if (!replicated) throw notReplicated(ack, acked);
    decided = result;
  }
  return startDecisionOf(decided as string);
}

/** The run's start decision in its record at `key`, if one was made. */
export async function readStartDecision(redis: RedisClient, key: string): Promise<StartDecision | undefined> {
  const decided = await redis.hget(key, "started");
  return decided === null ? undefined : startDecisionOf(decided);
}

function startDecisionOf(decided: string): StartDecision {
  return decided === "expired" ? "expired" : Number(decided);
}

/** A job's status record (tenant, status (none while queued), error) and the key it is under. */
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
