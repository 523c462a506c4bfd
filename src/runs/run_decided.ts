/**
 * A run decided elsewhere: the pre-check before the model is called, and how a delivery ends when its job was
 * decided (done, cancelled, expired or failed by another delivery) while it ran.
 */
import type { Outcome } from "../jobs/job_store.ts";
import { PermanentJobError } from "../queue/errors.ts";
import { acceptedMsOf, type StreamMessage } from "../queue/message.ts";
import type { Committed } from "./commit.ts";
import { JOB_RECORD_TTL_S } from "./keys.ts";
import type { Delivery, Job } from "./run_deps.ts";

/**
 * Another delivery decided this job failed, but may not have moved its message to the dead letters yet
 * (it may have died in between). Thrown, not returned: the message must stay pending rather than be
 * acknowledged, so that, if it is still there, a later delivery dead-letters it (the pre-check), and if the
 * other delivery finished, nothing is left to do.
 */
export class JobFailedElsewhere extends Error {
  constructor(jobId: string) {
    super(`job ${jobId} was decided failed by another delivery`);
    this.name = "JobFailedElsewhere";
  }
}

/**
 * A message older than this that Postgres finds undecided has its status record asked too: the least age at which
 * retention deletes an outcome (with SUMMARY_RETENTION_S) is a day longer.
 */
export const RECORD_CHECK_AFTER_MS = JOB_RECORD_TTL_S * 1000;

/** A message's entry among the pre-checks made ahead: its id and job (two lanes may use the same entry ids). */
export function preparedKey(message: StreamMessage): string {
  return `${message.fields.job_id}\n${message.id}`;
}

/**
 * Cheap pre-check: a redelivery of a committed job (crash between commit and
 * XACK), or a cancelled or expired job, skips the model call. The guarantee is the
 * outcome's primary key at the commit.
 * @returns how the delivery ends without a model call, or undefined to go on.
 * @throws {PermanentJobError} when the job was decided failed but its message is still here.
 */
export async function preCheck(
  job: Job,
  { job_id, tenant, message, log }: Delivery,
  releaseFirst: (why: string) => Promise<void>,
): Promise<Committed | undefined> {
  let outcome: Outcome | undefined;
  // Made when the message was read ahead, if it was. Only a decision found then is final (a job decided stays
  // decided); "not decided" may be stale by the time a slot frees (a cancel since), so it is asked again now.
  const key = preparedKey(message);
  const prepared = job.prepared.get(key);
  job.prepared.delete(key);
  try {
    outcome = (await prepared) ?? await job.decided(job_id);
    // A run cancelled while it waited for weeks: its outcome row may be gone, its record says so.
    const accepted = acceptedMsOf(message);
    if (!outcome && job.recordStatus && accepted !== undefined && Date.now() - accepted > RECORD_CHECK_AFTER_MS) {
      if (await job.recordStatus(job_id, tenant) === "cancelled") outcome = "cancelled";
    }
  } catch (error) {
    await releaseFirst("pre-check failed");
    throw error;
  }
  if (outcome === "failed") {
    // Decided failed, but its message is still here: the dead-letter step stopped between its two stores.
    await releaseFirst("job already failed");
    throw new PermanentJobError("the job had already failed (dead-lettered by an earlier delivery)");
  }
  if (!outcome) return undefined;
  await releaseFirst(`job already ${outcome}`);
  const event = { done: "job_duplicate", cancelled: "job_cancelled", expired: "job_expired" }[outcome];
  log.info(event, { stage: "pre_check", deliveries: message.deliveries });
  return outcome === "done" ? "duplicate" : outcome;
}

/**
 * How a delivery ends when its job was decided while it ran: logged; a failure elsewhere is thrown (the
 * message stays pending, see {@linkcode JobFailedElsewhere}).
 * @throws {JobFailedElsewhere} when another delivery decided it failed.
 */
export function endedBy({ job_id, message, log }: Delivery, outcome: Outcome, stage: string): Committed {
  const event = {
    done: "job_duplicate",
    cancelled: "job_cancelled",
    failed: "job_failed_elsewhere",
    expired: "job_expired",
  }[outcome];
  log.info(event, { stage, deliveries: message.deliveries });
  if (outcome === "failed") throw new JobFailedElsewhere(job_id);
  return outcome === "done" ? "duplicate" : outcome;
}
