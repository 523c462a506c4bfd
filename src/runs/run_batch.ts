/**
 * A run with priority `batch` (issue 43) whose model has a deployment marked `"batch": true`: recorded into that
 * deployment's open batch in Postgres instead of called now. The delivery resolves, and its message is
 * acknowledged, only once the run is recorded there; a redelivery (a crash between the two) finds it recorded.
 * From then on the batch services (`src/batches/`) own the run: upload, creation, polling, and the commit of its
 * line through the same commit and outbox as every run.
 */
import { acceptedMsOf } from "../queue/message.ts";
import type { Committed } from "./commit.ts";
import { preCheck } from "./run_decided.ts";
import { type Answered, worstCaseOf } from "./run_call.ts";
import { GateRefused } from "../retry/errors.ts";
import type { Delivery, Job, ModelCall } from "./run_deps.ts";

/** The fields of a message that carries its structured run's answer from its batch line (`batch_online.ts`). */
export const BATCH_ANSWER_FIELD = "batch_answer";
export const BATCH_MODEL_FIELD = "batch_model";

/** A structured run's answer from its batch line, when its message carries one: the worker checks it, no call. */
export function batchAnswerOf(delivery: Delivery): Answered | undefined {
  const { fields } = delivery.message;
  const text = fields[BATCH_ANSWER_FIELD], model = fields[BATCH_MODEL_FIELD];
  return text === undefined || model === undefined ? undefined : { text, model };
}

/** How a delivery ends when its run was recorded into a batch (by it or by an earlier delivery). */
export type Batched = "batched";

/**
 * Records the delivery's run into a batch when it is a batch run its deployments can take.
 * @returns "batched" when recorded (now or before); how it ended when it was decided before (the pre-check);
 * undefined when it runs online (not a batch run, no batch deployment of its model, a tenant whose budget has no room
 * for its worst case, or a run with an expiry).
 */
export async function intoBatch(
  job: Job,
  delivery: Delivery,
  { call }: { call: ModelCall },
): Promise<Committed | Batched | undefined> {
  const { run } = delivery;
  if (!job.batches || run.priority !== "batch") return undefined;
  // A batch line's call starts when the provider gets to it, which nothing here bounds: an expiring run is online.
  if (run.expiresAt !== undefined) return undefined;
  const target = job.batches.target(call.models);
  if (!target) return undefined;
  // A run cancelled (or already done) before it was recorded is not recorded: its line would be paid for nothing.
  const skip = await preCheck(job, delivery, () => Promise.resolve());
  if (skip) return skip;
  // Recorded by an earlier delivery (its worker died before the ack): nothing more to hold or record. Asked before
  // the hold, so that a line settled since (its hold gone) is not held again.
  if (job.budgets && await job.batches.recorded(delivery.job_id)) return batched(delivery, target, "already");
  const held = await holdLine(job, delivery, target.model, call);
  if (held === "refused") return undefined;
  const recorded = await job.batches.record({
    runId: delivery.job_id,
    tenant: delivery.tenant,
    payload: delivery.message.fields.payload!,
    acceptedMs: acceptedMsOf(delivery.message),
    call,
    target,
    held,
  });
  // Recorded: held again if the hash lost the hold meanwhile (rebuilt from a snapshot before this commit, or swept
  // while no line stood behind it). A failure is logged: the hold is then missing only in those windows.
  if (held && recorded === "recorded") {
    await job.budgets?.keepHold(delivery.tenant, delivery.job_id, held)
      .catch((error) => delivery.log.warn("batch_hold_keep_failed", { error }));
  }
  return batched(delivery, target, recorded);
}

/**
 * Holds the line's worst case at batch prices against the tenant's budgets until the line settles (the provider
 * makes the call when it will, up to a day later), so batches in flight never take a tenant past a budget.
 * @returns what is held (undefined: no budget), or "refused" when it does not fit: the run is not collected and
 * goes online as `low`, where the reservation before its call holds it back like any run of that tenant. The hold
 * is the run's (its id): a redelivery finds it held. Should the run never be recorded (a worker killed here and the
 * run cancelled before its redelivery), the holds' sweep releases it.
 */
async function holdLine(
  job: Job,
  delivery: Delivery,
  model: string,
  call: ModelCall,
): Promise<{ tokens: number; nanos: number } | undefined | "refused"> {
  try {
    return await job.budgets?.hold(delivery.tenant, model, worstCaseOf(call), delivery.job_id);
  } catch (error) {
    if (!(error instanceof GateRefused)) throw error;
    delivery.log.info("run_not_batched_budget", { model, error: error.message });
    return "refused";
  }
}

/** Logs the run collected (now, or by an earlier delivery) and says so. */
function batched(
  delivery: Delivery,
  target: { deployment: string; model: string },
  recorded: "recorded" | "already",
): Batched {
  delivery.log.info(recorded === "recorded" ? "run_batched" : "run_batched_before", {
    deployment: target.deployment,
    model: target.model,
    deliveries: delivery.message.deliveries,
  });
  return "batched";
}
