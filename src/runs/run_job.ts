import type { Sql } from "postgres";
import { linkedSignal } from "../async/linked_signal.ts";
import { z } from "zod";
import { type CallOptions, estimateTokens, type LLM, MAX_OUTPUT_TOKENS } from "../llm/llm.ts";
import type { Logger } from "../log/logger.ts";
import { JobDeferred, PermanentJobError } from "../queue/errors.ts";
import { BudgetExhausted, type Budgets, type HeldReservation, worstCaseTokens } from "../budgets/budgets.ts";
import type { CallEnd } from "../budgets/charge.ts";
import { acceptedMsOf, type StreamMessage } from "../queue/message.ts";
import { JOB_RECORD_TTL_S } from "./keys.ts";
import { isRetryable } from "../retry/classify.ts";
import type { Clock } from "../retry/clock.ts";
import { Deadline } from "../retry/deadline.ts";
import { DeadlineExceeded, GateUnavailable } from "../retry/errors.ts";
import type { Permit, ProviderFlow } from "../provider/flow_control.ts";
import { type AttemptDetails, type AttemptReport, callWithRetries } from "../retry/retry_policy.ts";
import type { Completion } from "../llm/llm.ts";
import { attemptCharge, attemptCost, type AttemptLog, attemptRow } from "./attempt_log.ts";
import { type CallTokens, chargeOf } from "../budgets/charge.ts";
import type { Prices } from "../llm/prices.ts";
import type { Outcome } from "../jobs/job_store.ts";
import { type Committed, createDecidedCheck, type GroupCommitter } from "./commit.ts";
import { contextFrom, currentTraceparent, inSpan, recordSpan } from "../tracing.ts";
import { type RunJob, runOfPayload } from "./run_payload.ts";
import { type LoadedTask, SUMMARIZE_TASK, type TaskCache } from "../tasks/task_cache.ts";
import { RENDER_LIMITS, renderedChars, renderTemplate } from "../tasks/definition.ts";
import { SchemaRefused, type SchemaViolation, unstorableJson } from "../tasks/json_schema.ts";
import { type SchemaValidators, validateWithin, ValidationTooCostly } from "../tasks/validator.ts";
import type { ResultCache, RunCache } from "../cache/result_cache.ts";
import type { CacheHit } from "../cache/cache_hit_store.ts";

/** Options for {@linkcode createSummaryJob}. */
export interface SummaryJobOptions {
  /** Budget of one delivery across attempts and sleeps (JOB_BUDGET_S). */
  budgetMs: number;
  perCallTimeoutMs: number;
  maxAttempts: number;
  clock?: Clock;
  random?: () => number;
  backoffBaseMs?: number;
  backoffCapMs?: number;
  onAttempt?: (report: AttemptReport & { job_id: string }) => void;
  /** The configured model's name, recorded for attempts whose answer does not name one. */
  model?: string;
}

const NO_TOKENS: CallTokens = { prompt: 0, completion: 0 };

/**
 * An attempt's tokens, request id and model from the completion, or its error's class and request id; and what
 * it is charged on (`chargeOf`'s rule, read while the error is at hand).
 */
function describeAttempt({ value, error }: { value?: Completion; error?: unknown }): AttemptDetails {
  const charge = chargeOf({ value, error }, NO_TOKENS).basis;
  if (value) {
    return {
      prompt_tokens: value.usage?.prompt_tokens,
      completion_tokens: value.usage?.completion_tokens,
      request_id: value.requestId,
      model: value.model,
      charge,
    };
  }
  const headers = (error as { headers?: unknown })?.headers;
  return {
    error_class: error instanceof Error ? error.name : "Error",
    request_id: headers instanceof Headers ? headers.get("x-request-id") ?? undefined : undefined,
    charge,
  };
}

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

/** The job was decided (cancelled, or done or failed by another delivery) while it ran: no more model calls. */
class JobDecided extends Error {
  constructor(jobId: string, readonly outcome: Outcome) {
    super(`job ${jobId} was ${outcome} meanwhile`);
    this.name = "JobDecided";
  }
}

/** The between-attempts check of the job's outcome failed (Postgres did not answer): transient, never permanent. */
class DecidedCheckFailed extends Error {
  constructor(jobId: string, options: ErrorOptions) {
    super(`the outcome of job ${jobId} could not be read between attempts`, options);
    this.name = "DecidedCheckFailed";
  }
}

/** SQLSTATE class 22, "data exception": the value itself is wrong, so a retry fails the same way. */
const DATA_EXCEPTION_CLASS = "22";

function isDataException(error: unknown): boolean {
  const code = (error as { code?: unknown })?.code;
  return typeof code === "string" && code.startsWith(DATA_EXCEPTION_CLASS) && code.length === 5;
}

/** A job message's fields, as a worker reads them. */
export const JobFields = z.object({ job_id: z.uuid(), tenant: z.string().min(1), payload: z.string() });
/** zod's own pattern for `z.uuid()`. */
const UUID = z.regexes.uuid();

/**
 * A job message's fields as {@linkcode JobFields} reads them: the usual message (three strings, a UUID, a tenant)
 * by a direct check, anything else by zod, whose error names what is wrong. zod's parse of the fields and of
 * the payload was 2% of the worker's CPU under load.
 * @throws {PermanentJobError} for a malformed message.
 */
export function jobFields(fields: Record<string, unknown>): z.infer<typeof JobFields> {
  const { job_id, tenant, payload } = fields;
  if (typeof job_id === "string" && typeof tenant === "string" && typeof payload === "string" && tenant !== "") {
    if (UUID.test(job_id)) return { job_id, tenant, payload };
  }
  const parsed = JobFields.safeParse(fields);
  if (!parsed.success) throw new PermanentJobError(`malformed job message: ${parsed.error.issues[0]?.message}`);
  return parsed.data;
}

/**
 * The summary job: model call, then summary + outbox row in one transaction.
 * Safe under redelivery: a committed job skips the model, and a racing
 * delivery that loses the insert writes no outbox row. A cancelled job skips
 * the model too, and a cancel that wins the race with the commit leaves
 * nothing written.
 * @returns "done" when this delivery committed the job, "cancelled" when it
 * was cancelled, "duplicate" when it was already done.
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
    modelName: options.model ?? "unknown",
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

/** A message's entry among the pre-checks made ahead: its id and job (two lanes may use the same entry ids). */
function preparedKey(message: StreamMessage): string {
  return `${message.fields.job_id}\n${message.id}`;
}

/** What {@linkcode createSummaryJob} needs. */
export interface SummaryJobDeps {
  sql: Sql;
  llm: LLM;
  log: Logger;
  committer: GroupCommitter;
  /** The record of model attempts (`model_attempts`); none when unset. */
  attempts?: AttemptLog;
  /** The provider's shared limiter and breaker; every attempt waits for its permit. */
  flow?: ProviderFlow;
  /** Task versions (runs of tasks other than summarize); without it, only summary jobs run. */
  tasks?: TaskCache;
  /**
   * Validates a model's answer against a task's output schema, compiled once per `key`; the schema is compiled
   * (`prepare`) before the model is called.
   */
  validators?: Pick<SchemaValidators, "validate" | "prepare">;
  /** Tenant budgets: every call's worst case is reserved before it and settled after it. */
  budgets?: Budgets;
  /** A run's budget is spent: told before the run is deferred, so its tenant's lane is not read meanwhile. */
  budgetExhausted?: (error: BudgetExhausted) => void;
  /** Model prices (LLM_PRICES): each attempt's `cost_usd`; without them, or for a model without one, NULL. */
  prices?: Prices;
  /** The result cache; without it, every run calls the model. */
  cache?: ResultCache;
  /**
   * The status its Redis record gives a job (`queued`, `cancelled`, ...), asked only of a message older than
   * {@linkcode RECORD_CHECK_AFTER_MS} that Postgres finds undecided: retention may have deleted the outcome of a
   * job cancelled while it waited that long, and the record, which lives as long as the message waits, still says.
   */
  recordStatus?: (jobId: string, tenant: string) => Promise<string | undefined>;
}

/**
 * A message older than this that Postgres finds undecided has its status record asked too: the least age at which
 * retention deletes an outcome (with SUMMARY_RETENTION_S) is a day longer.
 */
export const RECORD_CHECK_AFTER_MS = JOB_RECORD_TTL_S * 1000;

/**
 * Handles one delivery of a summary job. `finishing` is called once only the commit is left (the model's part is
 * over): the worker may then read the job that takes its slot next. `prepare` makes the pre-check of a message
 * read ahead while it waits for its slot, so that its model call can start the moment it runs.
 */
export type SummaryJob =
  & ((message: StreamMessage, signal: AbortSignal, finishing?: () => void) => Promise<Committed>)
  & { prepare(message: StreamMessage): void };

/** What one summary job's deliveries share. */
interface Job extends SummaryJobDeps {
  options: SummaryJobOptions;
  decided: (jobId: string) => Promise<Outcome | undefined>;
  modelName: string;
  /** Pre-checks made when messages were read ahead (`prepare`), by message, until their deliveries take them. */
  prepared: Map<string, Promise<Outcome | undefined>>;
}

/** One delivery's job, read from its message. */
interface Delivery {
  message: StreamMessage;
  job_id: string;
  tenant: string;
  run: RunJob;
  log: Logger;
  /** Attempts recorded so far: a repair call's attempts continue the first call's numbering. */
  recorded: number;
  /** The tokens this delivery's model calls used, as reported: what its result costs (a cache entry's). */
  usage: { prompt: number; completion: number };
  /** The result cache as this run sees it, when it is on for the run: a done result fills it. */
  cache?: RunCache;
  /** Tells the worker that only the commit is left. */
  finishing?: () => void;
}

/** One model call of a run: the user message and how to ask. */
interface ModelCall {
  prompt: string;
  options: Omit<CallOptions, "signal">;
  /** The model recorded for its attempts. */
  model: string;
}

async function deliver(
  job: Job,
  message: StreamMessage,
  signal: AbortSignal,
  finishing: (() => void) | undefined,
): Promise<Committed> {
  const delivery = { ...parseDelivery(job, message), finishing };
  const task = await loadTask(job, delivery);
  const call = modelCall(job, task, delivery.run.input);
  // Off for this run (a TTL of 0), the cache costs nothing: no hash, no Redis, and the first permit is asked for
  // in this tick as before.
  const cache = job.cache?.forRun({
    tenant: delivery.tenant,
    runId: delivery.job_id,
    task: task.name,
    version: task.version,
    definition: task.definition,
    model: call.model,
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
        const model = claim.hit.model ?? call.model;
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
  // Linked while the permit is awaited only: the worker's stop signal outlives every job (see linkedSignal).
  const waiting = job.flow && linkedSignal(signal, early.signal);
  const first = waiting &&
    job.flow!.acquire(estimated, waiting.signal, delivery.job_id, delivery.tenant).finally(waiting.unlink);
  first?.catch(() => {}); // observed below; never an unhandled rejection while the pre-check runs
  const releaseFirst = async (why: string) => {
    early.abort(new Error(why));
    await first?.then((permit) => permit.settle({ aborted: true }), () => {}).catch(() => {});
  };
  const skip = checked ? undefined : await preCheck(job, delivery, releaseFirst);
  if (skip) return skip;
  // One budget for the delivery, the repair call included.
  const deadline = Deadline.after(job.options.budgetMs, job.options.clock);
  const answer = await callModel(job, delivery, { call, estimated, first, signal, deadline });
  if (typeof answer !== "string") return answer.skipped;
  const schema = task.definition.output_schema;
  if (schema === undefined) return await commit(job, delivery, { output: answer, model: call.model });
  const output = await structuredOutput(job, delivery, { task, call, answer, estimated, signal, deadline });
  if (typeof output === "object" && output !== null && "skipped" in output) return output.skipped as Committed;
  return await commit(job, delivery, { output: (output as { value: unknown }).value, model: call.model });
}

/** The task version the run names: summarize is built in; another is read through the cache. */
async function loadTask(job: Job, { run, tenant }: Delivery): Promise<LoadedTask> {
  if (run.summary) return SUMMARIZE_TASK;
  let task: LoadedTask | undefined;
  try {
    task = job.tasks?.peek(tenant, run.task, run.version) ?? await job.tasks?.get(tenant, run.task, run.version);
  } catch (error) {
    throw new GateUnavailable(`task ${run.task} v${run.version} could not be read`, { cause: error });
  }
  if (!task) throw new PermanentJobError(`task ${run.task} version ${run.version} does not exist`);
  await prepareOutput(job, task);
  return task;
}

/**
 * A version stored by an earlier release may have an output schema this one cannot run (a pattern RE2 cannot
 * express): found before the model is called (compiled where its answers will be validated, once per version),
 * and the run fails for good, instead of paying for a call on every delivery whose answer can never be checked.
 */
async function prepareOutput(job: Job, task: LoadedTask): Promise<void> {
  const schema = task.definition.output_schema;
  if (schema === undefined || !job.validators) return;
  try {
    await job.validators.prepare(`${task.key}/output`, schema);
  } catch (error) {
    if (error instanceof SchemaRefused) {
      throw new PermanentJobError(
        `the output schema of task ${task.name} cannot be run by this release (${error.message}): PUT a new version`,
      );
    }
    // A Worker that ran over or was busy: no verdict on the schema. The message stays pending.
    throw new GateUnavailable(`the output schema of task ${task.name} could not be compiled now`, { cause: error });
  }
}

/** The run's call: the rendered templates, the task's model (the first of a list) and its output settings. */
function modelCall(job: Job, { name, definition }: LoadedTask, input: Record<string, unknown>): ModelCall {
  // Intake refuses such an input; a message from elsewhere (a replayed dead letter of a changed limit) is
  // refused here before rendering it.
  const chars = renderedChars(definition, input);
  if (chars > RENDER_LIMITS.maxChars) {
    throw new PermanentJobError(`the rendered prompt would be ${chars} characters (at most ${RENDER_LIMITS.maxChars})`);
  }
  const model = Array.isArray(definition.model) ? definition.model[0] : definition.model;
  return {
    prompt: renderTemplate(definition.prompt, input),
    model: model ?? job.modelName,
    options: {
      ...(definition.system === undefined ? {} : { system: renderTemplate(definition.system, input) }),
      ...(model === undefined ? {} : { model }),
      ...(definition.temperature === undefined ? {} : { temperature: definition.temperature }),
      maxOutputTokens: definition.max_output_tokens,
      ...(definition.output_schema === undefined
        ? {}
        : { jsonSchema: { name: name.replace(/[^a-zA-Z0-9_-]/g, "_"), schema: definition.output_schema } }),
    },
  };
}

/**
 * Settles a call's reservation, trying again twice over a second when Redis refuses: one left unsettled is held
 * as in flight for up to 30 minutes, then charged whole (see `budget_scripts.ts`).
 */
async function settleBudget(held: HeldReservation, end: CallEnd, log: Logger): Promise<void> {
  for (let attempt = 1;; attempt++) {
    try {
      return await held.settle(end);
    } catch (error) {
      if (attempt >= 3) return log.warn("budget_settle_failed", { error });
      await new Promise((resolve) => setTimeout(resolve, 250 * attempt));
    }
  }
}

/** A call's worst case for the budgets: every message it sends and every output token it may write. */
function worstCaseOf({ prompt, options }: ModelCall) {
  const messages = [prompt, ...(options.system === undefined ? [] : [options.system])];
  for (const turn of options.followUp ?? []) messages.push(turn.content);
  // A structured-output call sends its schema too (response_format), which the provider counts as prompt tokens.
  if (options.jsonSchema) messages.push(options.jsonSchema.name + JSON.stringify(options.jsonSchema.schema));
  return worstCaseTokens(messages, options.maxOutputTokens ?? MAX_OUTPUT_TOKENS);
}

/** What is wrong with an answer, in words the model can act on, and where (a JSON pointer into the answer). */
type Refusal = { pointer: string; reason: string };

/** Parses and validates an answer against the task's output schema: its value, or what is wrong with it. */
async function checkAnswer(
  job: Job,
  task: LoadedTask,
  { answer, deadline, signal }: { answer: string; deadline: Deadline; signal: AbortSignal },
): Promise<{ value: unknown } | Refusal> {
  let value: unknown;
  try {
    value = JSON.parse(answer);
  } catch (error) {
    return { pointer: "", reason: `is not valid JSON (${(error as Error).message})` };
  }
  const unstorable = unstorableJson(value);
  if ("pointer" in unstorable) {
    return { pointer: unstorable.pointer, reason: `cannot be stored: ${unstorable.message}` };
  }
  if (!job.validators) throw new Error("no output validator configured for runs with an output schema");
  // A validation that timed out or found the validators busy is no verdict (a starved Worker runs over too, a full
  // pool is the pool's): asked again within the delivery's deadline, never a bad answer, so never a repair call.
  // Past the deadline, or any failure of the validator (a Worker that did not start), is thrown: the message stays
  // pending and a later delivery validates again. An answer estimated at more work than a validation may do would
  // be so on every try: that is a verdict, a bad answer.
  let violations: SchemaViolation[];
  try {
    violations = await validateWithin(job.validators.validate, {
      key: `${task.key}/output`,
      schema: task.definition.output_schema,
      instance: value,
    }, { deadline, signal, clock: job.options.clock, random: job.options.random });
  } catch (error) {
    if (!(error instanceof ValidationTooCostly)) throw error;
    return { pointer: "", reason: `cannot be validated against the output schema: ${error.message}` };
  }
  if (violations.length === 0) return { value };
  const shown = violations.slice(0, 5).map((v) => `at "${v.pointer}": ${v.message}`).join("; ");
  return { pointer: violations[0]!.pointer, reason: `does not match the output schema: ${shown}` };
}

/**
 * The answer as the output schema's value: parsed and validated; when it fails, one repair call sends the
 * answer back with what was wrong, and a second failure fails the run for good, naming the first pointer.
 */
async function structuredOutput(
  job: Job,
  delivery: Delivery,
  { task, call, answer, estimated, signal, deadline }: {
    task: LoadedTask;
    call: ModelCall;
    answer: string;
    estimated: number;
    signal: AbortSignal;
    deadline: Deadline;
  },
): Promise<{ value: unknown } | { skipped: Committed }> {
  const first = await checkAnswer(job, task, { answer, deadline, signal });
  if ("value" in first) return first;
  delivery.log.info("output_invalid", { pointer: first.pointer, repair: true });
  // A cancel (or another delivery's outcome) seen now stops the run before the repair call is paid for.
  const decided = await job.decided(delivery.job_id);
  if (decided) return { skipped: endedBy(delivery, decided, "before_repair") };
  const repair: ModelCall = {
    ...call,
    options: {
      ...call.options,
      followUp: [
        { role: "assistant", content: answer },
        {
          role: "user",
          content: `That answer ${first.reason}. Answer again with only the JSON value, valid against the schema.`,
        },
      ],
    },
  };
  const added = repair.options.followUp!.reduce((n, turn) => n + turn.content.length, 0);
  const again = await callModel(job, delivery, {
    call: repair,
    estimated: estimated + Math.ceil(added / 4),
    first: undefined,
    signal,
    deadline,
  });
  if (typeof again !== "string") return again;
  const second = await checkAnswer(job, task, { answer: again, deadline, signal });
  if ("value" in second) return second;
  throw new PermanentJobError(`output_invalid: at "${second.pointer}": the answer ${second.reason.slice(0, 400)}`);
}

function parseDelivery(job: Job, message: StreamMessage): Delivery {
  const { job_id, tenant, payload } = jobFields(message.fields);
  let run: RunJob;
  try {
    run = runOfPayload(payload);
  } catch (cause) {
    throw new PermanentJobError("malformed job payload", { cause });
  }
  const log = job.log.child(
    run.summary ? { job_id, tenant, msg_id: message.id } : { job_id, tenant, task: run.task, msg_id: message.id },
  );
  return { message, job_id, tenant, run, log, recorded: 0, usage: { prompt: 0, completion: 0 } };
}

/**
 * Cheap pre-check: a redelivery of a committed job (crash between commit and
 * XACK), or a cancelled job, skips the model call. The guarantee is the
 * outcome's primary key at the commit.
 * @returns how the delivery ends without a model call, or undefined to go on.
 */
async function preCheck(
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
  const event = outcome === "done" ? "job_duplicate" : "job_cancelled";
  log.info(event, { stage: "pre_check", deliveries: message.deliveries });
  return outcome === "done" ? "duplicate" : "cancelled";
}

/**
 * The model call, with retries under the job's deadline and the provider's
 * permits (the first one asked for already).
 * @returns the summary, or how the delivery ended when the job was decided meanwhile.
 */
async function callModel(
  job: Job,
  delivery: Delivery,
  { call, estimated, first, signal, deadline }: {
    call: ModelCall;
    estimated: number;
    deadline: Deadline;
    first: Promise<Permit> | undefined;
    signal: AbortSignal;
  },
): Promise<string | { skipped: Committed }> {
  const { llm, flow, options } = job;
  const { job_id } = delivery;
  try {
    const completion = await callWithRetries((s) => llm.complete(call.prompt, { ...call.options, signal: s }), {
      gate: (flow || job.budgets) && {
        acquire: async (s) => {
          const pending = first;
          first = undefined;
          const permit: Permit | undefined = await (pending ?? flow?.acquire(estimated, s, job_id, delivery.tenant));
          // The budget once the call may go: a reservation is held only while its call runs (not through a wait
          // for the provider), so one that is never settled (its worker killed) is a call that may have been billed.
          let held: HeldReservation | undefined;
          try {
            held = await job.budgets?.reserve(delivery.tenant, call.model, worstCaseOf(call));
          } catch (error) {
            // Refused (or the budget unreadable): the permit goes back unused.
            await permit?.settle({ aborted: true }).catch(() => {});
            throw error;
          }
          if (!held) return permit!;
          return {
            waitedMs: permit?.waitedMs ?? 0,
            settle: async (outcome) => {
              // A call aborted while it ran (a stop) may have been billed: charged its reservation.
              // One stopped before it went out costs nothing.
              const end = outcome.notSent
                ? { notSent: true }
                : outcome.aborted
                ? { error: new Error("aborted while in flight") }
                : outcome;
              const [absorbed] = await Promise.all([
                permit ? permit.settle(outcome) : false,
                settleBudget(held, end, delivery.log),
              ]);
              return absorbed;
            },
          };
        },
      },
      deadline,
      perCallTimeoutMs: options.perCallTimeoutMs,
      maxAttempts: options.maxAttempts,
      baseMs: options.backoffBaseMs,
      capMs: options.backoffCapMs,
      clock: options.clock,
      random: options.random,
      signal,
      describe: describeAttempt,
      // A cancel (or another delivery's commit or dead letter) during an attempt stops the job before its next call.
      // A check Postgres cannot answer (a failover, a terminated connection) is transient, not the model's verdict.
      beforeRetry: async () => {
        const now = await job.decided(job_id).catch((cause) => {
          throw new DecidedCheckFailed(job_id, { cause });
        });
        if (now) throw new JobDecided(job_id, now);
      },
      onAttempt: (report) => recordAttempt(job, delivery, report, call),
    });
    return completion.text;
  } catch (error) {
    if (error instanceof JobDecided) return { skipped: endedBy(delivery, error.outcome, "between_attempts") };
    if (error instanceof BudgetExhausted) {
      // Back to the end of its lane, no delivery spent; the lane is not read until the budget fits again.
      job.budgetExhausted?.(error);
      delivery.log.info("run_waiting_for_budget", { budget: error.budget, retry_after_s: error.retryAfterS });
      throw new JobDeferred(error.message, { cause: error });
    }
    // Postgres's error, left to leave the message pending: without this it read as a permanent model error.
    if (error instanceof DecidedCheckFailed) throw error.cause;
    // Transient: leave the message pending; redelivery brings a fresh budget.
    if (signal.aborted || error instanceof DeadlineExceeded || error instanceof GateUnavailable) throw error;
    if (isRetryable(error)) throw error;
    const name = error instanceof Error ? (error.name === "Error" ? error.constructor.name : error.name) : "Error";
    throw new PermanentJobError(`${name}: ${error instanceof Error ? error.message : String(error)}`, {
      cause: error,
    });
  }
}

/**
 * How a delivery ends when its job was decided while it ran: logged; a failure elsewhere is thrown (the
 * message stays pending, see {@linkcode JobFailedElsewhere}).
 */
function endedBy({ job_id, message, log }: Delivery, outcome: Outcome, stage: string): Committed {
  const event = { done: "job_duplicate", cancelled: "job_cancelled", failed: "job_failed_elsewhere" }[outcome];
  log.info(event, { stage, deliveries: message.deliveries });
  if (outcome === "failed") throw new JobFailedElsewhere(job_id);
  return outcome === "done" ? "duplicate" : outcome;
}

/** One attempt's span, log line and `model_attempts` row (with its cost, see {@linkcode attemptCost}). */
function recordAttempt(job: Job, delivery: Delivery, report: AttemptReport, call: ModelCall): void {
  const { model } = call;
  const { job_id, tenant, message, log, run } = delivery;
  if (report.started_at_ms !== undefined) {
    recordSpan("model.attempt", {
      startMs: report.started_at_ms,
      endMs: report.started_at_ms + report.duration_ms,
      failed: report.outcome !== "ok",
      attributes: {
        attempt: report.attempt,
        outcome: report.outcome,
        "http.response.status_code": report.status,
        "permit.wait_ms": report.permit_wait_ms,
        "retry.wait_ms": report.wait_ms,
        "gen_ai.usage.input_tokens": report.details?.prompt_tokens,
        "gen_ai.usage.output_tokens": report.details?.completion_tokens,
        "gen_ai.response.model": report.details?.model,
      },
    });
  }
  const { details, ...logged } = report;
  log[report.outcome === "ok" ? "debug" : "info"]("model_attempt", { ...logged, ...details });
  delivery.usage.prompt += details?.prompt_tokens ?? 0;
  delivery.usage.completion += details?.completion_tokens ?? 0;
  job.options.onAttempt?.({ ...report, job_id });
  // Numbered across the delivery's calls (a repair call's first attempt follows the first call's last), so each
  // row of `model_attempts` names one call.
  const row = attemptRow(report.started_at_ms === undefined ? report : { ...report, attempt: ++delivery.recorded }, {
    job_id,
    tenant,
    delivery: message.deliveries,
    model,
    task: run.task,
    version: run.version,
    deployment: model,
    cost_usd: report.started_at_ms === undefined
      ? null
      : attemptCost(report.details, worstCaseOf(call), job.prices?.of(model)),
    charged_tokens: report.started_at_ms === undefined ? null : attemptCharge(report.details, worstCaseOf(call)),
  });
  if (row) job.attempts?.record(row);
}

/** The result and its outbox row in one transaction (batched with other jobs' by the committer). */
async function commit(
  job: Job,
  delivery: Delivery,
  { output, model, cacheHit, waited }: { output: unknown; model: string; cacheHit?: CacheHit; waited?: boolean },
) {
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
            : { jobId: job_id, tenant, task, version, input, output, model, notify, traceparent, acceptedMs, cacheHit },
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
