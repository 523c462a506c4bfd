/**
 * The task the run benchmarks use: ticket triage with an input schema of
 * three properties and a ticket the size of the summary benchmark's
 * document, in two forms that differ only in the output schema, so the
 * worker's structured path (strict json_schema, parse, validation) can be
 * set against its text path.
 */
import { checkDefinition, TaskDefinition } from "../../src/tasks/definition.ts";
import type { RunPayload } from "../../src/runs/run_payload.ts";

/** A ticket of 91 characters: the summary benchmark's document has 88. */
export const TICKET = "The export button crashes on reports over 500 rows. It began after Monday's update to v4.2.";

const INPUT_SCHEMA = {
  type: "object",
  properties: {
    ticket: { type: "string", minLength: 1, maxLength: 20_000 },
    product: { type: "string", maxLength: 200 },
    channel: { type: "string", enum: ["email", "chat", "phone"] },
  },
  required: ["ticket", "product"],
  additionalProperties: false,
};

const OUTPUT_SCHEMA = {
  type: "object",
  properties: {
    category: { type: "string", enum: ["bug", "billing", "question"] },
    urgent: { type: "boolean" },
    summary: { type: "string" },
  },
  required: ["category", "urgent", "summary"],
  additionalProperties: false,
};

const TEXT_BODY = {
  system: "You triage support tickets for {{input.product}}, received by {{input.channel}}.",
  prompt: "Classify this ticket and summarise it in one sentence:\n\n{{input.ticket}}",
  input_schema: INPUT_SCHEMA,
  max_output_tokens: 200,
  temperature: 0,
};

/** `PUT /v1/tasks/{name}` bodies: the same task answering text, and answering JSON valid against a schema. */
export const TRIAGE_BODIES = {
  text: TEXT_BODY,
  json: { ...TEXT_BODY, output_schema: OUTPUT_SCHEMA },
} as const;

/** A task body as the API stores it (defaults filled in), checked as a PUT checks it. */
export function storedDefinition(body: unknown): TaskDefinition {
  return checkDefinition(TaskDefinition.parse(body)).definition;
}

/** The input of run `i`: its own ticket number, so no two prompts are equal. */
export function triageInput(i: number): RunPayload["input"] {
  return { ticket: `#${i} ${TICKET}`, product: "Acme CRM", channel: "email" };
}

/** Body of `POST /v1/tasks/{name}/runs` for the intake benchmark: the summary body's notify, the ticket as input. */
export const RUN_BODY = JSON.stringify({
  input: { ticket: TICKET, product: "Acme CRM", channel: "email" },
  notify: "ops@example.com",
});
