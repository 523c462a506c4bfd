/**
 * The run job: every task's run (a summary is a run of `summarize`) goes through it. It orchestrates one
 * delivery: load and render (`run_load.ts`), the pre-check (`run_decided.ts`), the result cache, the model call
 * (`run_call.ts`), the check and repair of a structured answer (`run_check.ts`) and the commit
 * (`run_commit.ts`); what they share is in `run_deps.ts`.
 */
import { linkedSignal } from "../async/linked_signal.ts";
import { estimateTokens } from "../llm/llm.ts";
import type { Acquired } from "../llm/models.ts";
import type { StreamMessage } from "../queue/message.ts";
import { Deadline } from "../retry/deadline.ts";
import { type Committed, createDecidedCheck } from "./commit.ts";
import { contextFrom, inSpan, recordSpan } from "../tracing.ts";
import type { LoadedTask } from "../tasks/task_cache.ts";
import type { RunCache } from "../cache/result_cache.ts";
import type { Delivery, Job, ModelCall, SummaryJobDeps, SummaryJobOptions } from "./run_deps.ts";
import { loadTask, modelCall, parseDelivery } from "./run_load.ts";
import { preCheck, preparedKey } from "./run_decided.ts";
import { type Answered, callModel } from "./run_call.ts";
import { beforeExpiry, expire, hasExpired, startedEarlier, untilExpiry } from "./run_expiry.ts";
import { structuredOutput } from "./run_check.ts";
import { commit } from "./run_commit.ts";
import { batchAnswerOf, type Batched, intoBatch } from "./run_batch.ts";

/**
 * The summary job: model call, then summary + outbox row in one transaction.
 * Safe under redelivery: a committed job skips the model, and a racing
 * delivery that loses the insert writes no outbox row. A cancelled job skips
 * the model too, and a cancel that wins the race with the commit leaves
 * nothing written.
 * @returns "done" when this delivery committed the job, "cancelled" when it
 * was cancelled, "expired" when it expired before its model call started,
 * "duplicate" when it was already done.
 * @throws {JobFailedElsewhere} when another delivery decided it failed first
 * (its commit wrote nothing), to leave the message pending.
 * @throws {PermanentJobError} for a malformed message or a model error no retry can fix.
 * @throws the retryable error, or {@linkcode DeadlineExceeded}, to leave the message pending.
 */
export function createSummaryJob(deps: SummaryJobDeps, options: SummaryJobOptions): SummaryJob {
  const job: Job = {
    ...deps,
    options,
    decided: createDecidedCheck(deps.sql),
    prepared: new Map(),
  };
  // Each delivery is a span of the job's trace (continued from the POST's), after its time in the queue.
  const handle = (message: StreamMessage, signal: AbortSignal, finishing?: () => void) => {
    const parent = contextFrom(message.fields.traceparent);
    const attributes = { "job.id": message.fields.job_id, tenant: message.fields.tenant, delivery: message.deliveries };
    const enqueuedMs = Number(message.id.split("-")[0]);
    if (message.deliveries === 1 && message.fields.traceparent && Number.isFinite(enqueuedMs)) {
      recordSpan("job.queued", { startMs: enqueuedMs, endMs: Date.now(), attributes, parent });
    }
    return inSpan("job.delivery", attributes, () => deliver(job, message, signal, finishing), parent);
  };
  return Object.assign(handle, {
    prepare(message: StreamMessage) {
      const jobId = message.fields.job_id;
      if (!jobId) return;
      // Bounded: a delivery takes its entry when it starts; only messages abandoned at a stop could pile up.
      if (job.prepared.size >= MAX_PREPARED) job.prepared.clear();
      // A check that failed (a Postgres blip) is no answer: kept as "not known", which the delivery asks again.
      job.prepared.set(preparedKey(message), job.decided(jobId).catch(() => undefined));
    },
  });
}

/** The most pre-checks made ahead and not yet taken by their deliveries. */
const MAX_PREPARED = 10_000;

/**
 * Handles one delivery of a summary job. `finishing` is called once only the commit is left (the model's part is
 * over): the worker may then read the job that takes its slot next. `prepare` makes the pre-check of a message
 * read ahead while it waits for its slot, so that its model call can start the moment it runs.
 */
export type SummaryJob =
  & ((message: StreamMessage, signal: AbortSignal, finishing?: () => void) => Promise<Committed | Batched>)
  & { prepare(message: StreamMessage): void };

async function deliver(
  job: Job,
  message: StreamMessage,
  signal: AbortSignal,
  finishing: (() => void) | undefined,
): Promise<Committed | Batched> {
  const delivery = { ...parseDelivery(job, message), finishing };
  // A run with an expiry whose attempt went out in an earlier delivery (its worker died mid-call, say) no longer
  // expires: its record's mark says so.
  await startedEarlier(job, delivery);
  // Taken at or after its expiry (it waited in its lane, was deferred for budget, or is reclaimed after a crash)
  // with no attempt sent: decided now, with no permit asked for and no task loaded. Unless something else decided
  // it first.
  if (hasExpired(delivery, job.options.clock)) {
    return await preCheck(job, delivery, () => Promise.resolve()) ?? await expire(job, delivery, "taken");
  }
  const task = await loadTask(job, delivery);
  const call = modelCall(task, delivery.run.input);
  // A structured run back from its batch with the line's answer: checked (and repaired online once) here.
  const fromBatch = batchAnswerOf(delivery);
  if (fromBatch) return await checkBatchAnswer(job, delivery, { task, call, answered: fromBatch, signal });
  // A batch run whose model has a batch deployment: recorded into a batch (the message is acknowledged after).
  const batched = await intoBatch(job, delivery, { call });
  if (batched) return batched;
  // Off for this run (a TTL of 0), the cache costs nothing: no hash, no Redis, and the first permit is asked for
  // in this tick as before.
  const cache = job.cache?.forRun({
    tenant: delivery.tenant,
    runId: delivery.job_id,
    task: task.name,
    version: task.version,
    definition: task.definition,
    model: call.models[0] ?? job.models.defaultModel,
    input: delivery.run.input,
    ttlS: task.definition.cache_ttl_s,
    noCache: delivery.run.noCache === true,
  });
  if (cache) return await throughCache(job, delivery, { task, call, cache, signal });
  return await answer(job, delivery, { task, call, signal });
}

/**
 * A run with the result cache on: the pre-check, then the lookup, before any permit is asked for and any model
 * call. A hit commits the source's output (through the committer, so a cancel or another delivery still decides
 * once). A miss answers from the model, holding the entry's lock so that identical runs wait for this one
 * instead of calling too, and fills the entry once done. The lock MUST be released however the delivery ends
 * (failed, cancelled, thrown): the waiters take over only then, or when its lease lapses.
 */
async function throughCache(
  job: Job,
  delivery: Delivery,
  { task, call, cache, signal }: { task: LoadedTask; call: ModelCall; cache: RunCache; signal: AbortSignal },
): Promise<Committed> {
  const skip = await preCheck(job, delivery, () => Promise.resolve());
  if (skip) return skip;
  delivery.cache = cache;
  try {
    let checked = true;
    if (cache.lookup) {
      const claim = await cache.claim(signal, Deadline.after(job.options.budgetMs, job.options.clock));
      if (claim.hit) {
        const model = claim.hit.model ?? call.models[0] ?? job.models.defaultModel;
        return await commit(job, delivery, { output: claim.output, model, cacheHit: claim.hit, waited: claim.waited });
      }
      // A run that waited for another's result may have been cancelled meanwhile: it looks again before paying.
      checked = !claim.waited;
    }
    return await answer(job, delivery, { task, call, signal, checked });
  } finally {
    await cache.release();
  }
}

/**
 * A structured run's answer from its batch line (its usage already recorded and charged at batch prices by the
 * poller): checked against the output schema as a first answer is, with one repair call online when it fails,
 * then committed. No first call, no cache.
 */
async function checkBatchAnswer(
  job: Job,
  delivery: Delivery,
  { task, call, answered, signal }: { task: LoadedTask; call: ModelCall; answered: Answered; signal: AbortSignal },
): Promise<Committed> {
  const skip = await preCheck(job, delivery, () => Promise.resolve());
  if (skip) return skip;
  if (task.definition.output_schema === undefined) {
    return await commit(job, delivery, { output: answered.text, model: answered.model });
  }
  const estimated = estimateTokens(call.prompt + (call.options.system ?? ""), task.definition.max_output_tokens);
  const deadline = Deadline.after(job.options.budgetMs, job.options.clock);
  const output = await structuredOutput(job, delivery, { task, call, answered, estimated, signal, deadline });
  if ("skipped" in output) return output.skipped;
  return await commit(job, delivery, { output: output.value, model: output.model });
}

/**
 * The run's answer from the model (its first permit asked for at once), committed. `checked`: the pre-check
 * has just been made.
 */
async function answer(
  job: Job,
  delivery: Delivery,
  { task, call, signal, checked = false }: {
    task: LoadedTask;
    call: ModelCall;
    signal: AbortSignal;
    checked?: boolean;
  },
): Promise<Committed> {
  const estimated = estimateTokens(call.prompt + (call.options.system ?? ""), task.definition.max_output_tokens);
  // Ask for the first permit now, in the same tick the worker started this job: the worker's next look at
  // the gate then counts this job as waiting, so it does not read more jobs than permits are coming.
  const early = new AbortController();
  // Linked while the permit is awaited only: the worker's stop signal outlives every job (see linkedSignal). A
  // run that expires while it waits (a provider's pause, a queue of permits) stops waiting then (`RunExpired`).
  const waiting = linkedSignal(signal, early.signal);
  const bounded = untilExpiry(delivery, waiting.signal, job.options.clock);
  const first: Promise<Acquired> = beforeExpiry(
    job.models.acquire(call.models, estimated, {
      signal: bounded.signal,
      jobId: delivery.job_id,
      tenant: delivery.tenant,
    }),
    bounded,
  ).finally(() => {
    bounded.done();
    waiting.unlink();
  });
  first.catch(() => {}); // observed below; never an unhandled rejection while the pre-check runs
  const releaseFirst = async (why: string) => {
    early.abort(new Error(why));
    await first.then((acquired) => acquired.permit?.settle({ aborted: true }), () => {}).catch(() => {});
  };
  const skip = checked ? undefined : await preCheck(job, delivery, releaseFirst);
  if (skip) return skip;
  // One budget for the delivery, the repair call included.
  const deadline = Deadline.after(job.options.budgetMs, job.options.clock);
  // The first attempt takes the permit; one never taken (a stop or the deadline ended the call before its first
  // attempt) goes back, so its tokens and a probe's lease are not held for nothing.
  const unclaimed: { pending?: Promise<Acquired> } = { pending: first };
  let answered: Awaited<ReturnType<typeof callModel>>;
  try {
    answered = await callModel(job, delivery, { call, estimated, first: unclaimed, signal, deadline });
  } finally {
    if (unclaimed.pending) await releaseFirst("the call ended before its first attempt");
  }
  if ("skipped" in answered) return answered.skipped;
  if (task.definition.output_schema === undefined) {
    return await commit(job, delivery, { output: answered.text, model: answered.model });
  }
  const output = await structuredOutput(job, delivery, { task, call, answered, estimated, signal, deadline });
  if ("skipped" in output) return output.skipped;
  return await commit(job, delivery, { output: output.value, model: output.model });
}
