/** A delivery's result committed: the result and its outbox row in one transaction, then the cache filled. */
import { PermanentJobError } from "../queue/errors.ts";
import { acceptedMsOf } from "../queue/message.ts";
import { currentTraceparent, inSpan } from "../tracing.ts";
import type { CacheHit } from "../cache/cache_hit_store.ts";
import type { Committed } from "./commit.ts";
import type { Delivery, Job } from "./run_deps.ts";
import { JobFailedElsewhere } from "./run_decided.ts";

/** SQLSTATE class 22, "data exception": the value itself is wrong, so a retry fails the same way. */
const DATA_EXCEPTION_CLASS = "22";

function isDataException(error: unknown): boolean {
  const code = (error as { code?: unknown })?.code;
  return typeof code === "string" && code.startsWith(DATA_EXCEPTION_CLASS) && code.length === 5;
}

/**
 * The result and its outbox row in one transaction (batched with other jobs' by the committer); a result this
 * run computed then fills the cache.
 * @throws {JobFailedElsewhere} when another delivery decided the job failed first (nothing was written).
 * @throws {PermanentJobError} when the result cannot be stored (a data exception fails on every delivery).
 */
export async function commit(
  job: Job,
  delivery: Delivery,
  { output, model, cacheHit, waited }: { output: unknown; model: string; cacheHit?: CacheHit; waited?: boolean },
): Promise<Committed> {
  const { job_id, tenant, run, message, log } = delivery;
  delivery.finishing?.();
  let committed: Committed;
  try {
    committed = await inSpan(
      "job.commit",
      { "job.id": job_id },
      // The outbox row carries this delivery's context, so the relay's send joins the job's trace.
      () => {
        const traceparent = currentTraceparent();
        const { task, version, input, notify } = run;
        const acceptedMs = acceptedMsOf(message);
        return job.committer.commit(
          run.summary
            ? { jobId: job_id, tenant, summary: output as string, notify: notify!, traceparent, acceptedMs, cacheHit }
            : {
              jobId: job_id,
              tenant,
              task,
              version,
              input,
              output,
              model,
              notify,
              traceparent,
              acceptedMs,
              cacheHit,
              // What this delivery's calls used, beside the result: read at once by the OpenAI-compatible door.
              ...(cacheHit ? {} : { tokens: { ...delivery.usage } }),
            },
        );
      },
    );
  } catch (error) {
    // A data exception (SQLSTATE class 22: bad encoding, a NUL, a value out of range) fails the same way on
    // every delivery: dead-letter the job now instead of paying for the model again and again.
    if (isDataException(error)) {
      const what = run.summary ? "the summary" : "the run's output";
      throw new PermanentJobError(`${what} cannot be stored: ${(error as Error).message}`, { cause: error });
    }
    throw error;
  }
  const event = {
    done: "job_done",
    duplicate: "job_duplicate",
    cancelled: "job_cancelled",
    failed: "job_failed_elsewhere",
    expired: "job_expired",
  }[committed];
  const hit = cacheHit ? { cached: true, source_run_id: cacheHit.sourceRunId, waited } : {};
  log.info(event, { stage: "commit", deliveries: message.deliveries, ...hit });
  if (committed === "failed") throw new JobFailedElsewhere(job_id);
  // Only a result this run computed fills the cache (best effort, never thrown), with what its calls cost.
  if (committed === "done" && !cacheHit && delivery.cache) {
    const { prompt, completion } = delivery.usage;
    await delivery.cache.fill({ output, model, promptTokens: prompt, completionTokens: completion });
  }
  return committed;
}
