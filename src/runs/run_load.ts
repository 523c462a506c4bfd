/** A delivery read from its message, its task version loaded, and its model call rendered. */
import { z } from "zod";
import { PermanentJobError } from "../queue/errors.ts";
import type { StreamMessage } from "../queue/message.ts";
import { GateUnavailable } from "../retry/errors.ts";
import { type RunJob, runOfPayload } from "./run_payload.ts";
import { type LoadedTask, SUMMARIZE_TASK } from "../tasks/task_cache.ts";
import { RENDER_LIMITS, renderedChars, renderTemplate } from "../tasks/definition.ts";
import { SchemaRefused } from "../tasks/json_schema.ts";
import { CHAT_TASK, chatCall } from "../tasks/chat_task.ts";
import type { Delivery, Job, ModelCall } from "./run_deps.ts";

/** A job message's fields, as a worker reads them. */
export const JobFields = z.object({ job_id: z.uuid(), tenant: z.string().min(1), payload: z.string() });
/** zod's own pattern for `z.uuid()`. */
const UUID = z.regexes.uuid();

/**
 * A job message's fields as {@linkcode JobFields} reads them: the usual message (three strings, a UUID, a tenant)
 * by a direct check, anything else by zod, whose error names what is wrong. zod's parse of the fields and of
 * the payload showed in the worker's profile under load (see README, "Per-job cost of the worker (issue 26)").
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
 * One delivery of a message: its job, tenant and run, and a log that names them.
 * @throws {PermanentJobError} for a malformed message or payload.
 */
export function parseDelivery(job: Job, message: StreamMessage): Delivery {
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
 * The task version the run names: summarize is built in; another is read through the cache.
 * @throws {PermanentJobError} when the version does not exist or this release cannot run its output schema.
 * @throws {GateUnavailable} when it could not be read or compiled now (the message stays pending).
 */
export async function loadTask(job: Job, { run, tenant }: Delivery): Promise<LoadedTask> {
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

/**
 * The run's call: the rendered templates, the task's models (a name, or names in order of preference) and its
 * output settings.
 * @throws {PermanentJobError} when the rendered prompt would be over the render limit.
 */
export function modelCall({ name, definition }: LoadedTask, input: Record<string, unknown>): ModelCall {
  // The built-in chat task sends the request's own messages, model and format (`tasks/chat_task.ts`).
  if (name === CHAT_TASK) {
    try {
      return chatCall(input);
    } catch (cause) {
      throw new PermanentJobError("malformed chat input", { cause });
    }
  }
  // Intake refuses such an input; a message from elsewhere (a replayed dead letter of a changed limit) is
  // refused here before rendering it.
  const chars = renderedChars(definition, input);
  if (chars > RENDER_LIMITS.maxChars) {
    throw new PermanentJobError(`the rendered prompt would be ${chars} characters (at most ${RENDER_LIMITS.maxChars})`);
  }
  const models = definition.model === undefined ? [] : [definition.model].flat();
  return {
    prompt: renderTemplate(definition.prompt, input),
    models,
    options: {
      ...(definition.system === undefined ? {} : { system: renderTemplate(definition.system, input) }),
      ...(definition.temperature === undefined ? {} : { temperature: definition.temperature }),
      maxOutputTokens: definition.max_output_tokens,
      ...(definition.output_schema === undefined
        ? {}
        : { jsonSchema: { name: name.replace(/[^a-zA-Z0-9_-]/g, "_"), schema: definition.output_schema } }),
    },
  };
}
