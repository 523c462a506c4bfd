/**
 * A structured answer checked against its task's output schema, and repaired once: the answer is sent back with
 * what was wrong, and a second failure fails the run for good.
 */
import { PermanentJobError } from "../queue/errors.ts";
import type { Deadline } from "../retry/deadline.ts";
import type { LoadedTask } from "../tasks/task_cache.ts";
import { type SchemaViolation, unstorableJson } from "../tasks/json_schema.ts";
import { validateWithin, ValidationTooCostly } from "../tasks/validator.ts";
import type { Committed } from "./commit.ts";
import type { Delivery, Job, ModelCall } from "./run_deps.ts";
import { endedBy } from "./run_decided.ts";
import { type Answered, callModel } from "./run_call.ts";

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
    const validators = job.validators;
    violations = await validateWithin(
      (key, schema, instance, signal) => validators.validate(key, schema, instance, undefined, signal),
      {
        key: `${task.key}/output`,
        schema: task.definition.output_schema,
        instance: value,
      },
      { deadline, signal, clock: job.options.clock, random: job.options.random },
    );
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
 * @returns the value and the model that answered it, or how the delivery ended when the job was decided meanwhile.
 * @throws {PermanentJobError} when the repaired answer is still wrong.
 */
export async function structuredOutput(
  job: Job,
  delivery: Delivery,
  { task, call, answered, estimated, signal, deadline }: {
    task: LoadedTask;
    call: ModelCall;
    answered: Answered;
    estimated: number;
    signal: AbortSignal;
    deadline: Deadline;
  },
): Promise<{ value: unknown; model: string } | { skipped: Committed }> {
  const answer = answered.text;
  const first = await checkAnswer(job, task, { answer, deadline, signal });
  if ("value" in first) return { value: first.value, model: answered.model };
  delivery.log.info("output_invalid", { pointer: first.pointer, repair: true });
  // A cancel (or another delivery's outcome) seen now stops the run before the repair call is paid for.
  const decided = await job.decided(delivery.job_id);
  if (decided) return { skipped: endedBy(delivery, decided, "before_repair") };
  const followUp = [
    { role: "assistant" as const, content: answer },
    {
      role: "user" as const,
      content: `That answer ${first.reason}. Answer again with only the JSON value, valid against the schema.`,
    },
  ];
  const repair: ModelCall = { ...call, options: { ...call.options, followUp } };
  const added = followUp.reduce((n, turn) => n + turn.content.length, 0);
  const again = await callModel(job, delivery, {
    call: repair,
    estimated: estimated + Math.ceil(added / 4),
    first: {},
    signal,
    deadline,
  });
  if ("skipped" in again) return again;
  const second = await checkAnswer(job, task, { answer: again.text, deadline, signal });
  if ("value" in second) return { value: second.value, model: again.model };
  throw new PermanentJobError(`output_invalid: at "${second.pointer}": the answer ${second.reason.slice(0, 400)}`);
}
