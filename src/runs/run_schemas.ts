import { z } from "zod";
import { isPlainEmail, SummaryRequest } from "./shapes.ts";

/** The longest `expires_in` a run may set: 7 days. A run that may wait longer does not need an expiry. */
export const MAX_EXPIRES_IN_S = 7 * 24 * 3600;

/** Body of `POST /v1/tasks/{name}/runs`. Unknown fields are rejected. */
export const RunRequest = z.strictObject({
  // Checked as an object here and against the task's input schema after: a per-key zod record would only
  // repeat, at a cost on every request, what the input schema checks.
  input: z.custom<Record<string, unknown>>(
    (v) => typeof v === "object" && v !== null && !Array.isArray(v),
    { message: "input must be a JSON object" },
  ).meta({
    type: "object",
    // Any property: without it, generators (openapi-typescript) type an object with no properties as
    // Record<string, never>, and no real input compiles without a cast.
    additionalProperties: {},
    description: "The input: a JSON object valid against the task's input_schema",
  }),
  version: z.number().int().min(1).optional().describe("The task version to run; the latest at intake when unset"),
  notify: SummaryRequest.shape.notify.optional(),
  priority: z.enum(["high", "normal", "low", "batch"]).optional().describe(
    "normal when unset. high runs overtake the same tenant's normal and low backlog (never other tenants' " +
      "shares); batch runs go through a deployment's Batch API where one offers it, else they run as low",
  ),
  expires_in: z.number().int().min(1).max(MAX_EXPIRES_IN_S).optional().describe(
    "Seconds (1 to 604800, 7 days) from acceptance: a run whose model call has not started by then ends " +
      "expired, with no model call and no charge, and its notification is run.expired. Each attempt (a retry, " +
      "the repair call, a redelivery's) starts only before the expiry; one already sent finishes",
  ),
});
export type RunRequest = z.infer<typeof RunRequest>;

/**
 * Parses a `POST /v1/tasks/{name}/runs` body as {@linkcode RunRequest} does, answering the common case (an
 * object input, and no other field or an email recipient) with a few checks; anything else, every refusal
 * included, is zod's to answer. zod's parse showed in the API's profile on this path under load (see README,
 * "Task runs (issue 23)").
 */
export function parseRunRequest(raw: unknown): z.ZodSafeParseResult<RunRequest> {
  if (
    typeof raw === "object" && raw !== null && !Array.isArray(raw) && Object.hasOwn(raw, "input") &&
    // zod reads a field through the prototype too: a body that is not a plain JSON object is zod's.
    !("version" in raw) && !("priority" in raw) && !("expires_in" in raw)
  ) {
    const { input, notify } = raw as Record<string, unknown>;
    const fields = Object.keys(raw).length;
    if (typeof input === "object" && input !== null && !Array.isArray(input)) {
      const object = input as Record<string, unknown>;
      if (fields === 1 && !("notify" in raw)) return { success: true, data: { input: object } };
      if (fields === 2 && typeof notify === "string" && Object.hasOwn(raw, "notify") && isPlainEmail(notify)) {
        return { success: true, data: { input: object, notify } };
      }
    }
  }
  return RunRequest.safeParse(raw);
}

/** Body of the 202 answer to a run. */
export const RunAccepted = z.object({ run_id: z.uuid(), status: z.literal("queued") });

/** Body of `GET /v1/runs/{run_id}` (and of `DELETE`, and of a finished `Prefer: wait`). */
export const RunDocument = z.object({
  run_id: z.uuid(),
  task: z.string(),
  version: z.number().int().min(1),
  status: z.enum(["queued", "done", "failed", "cancelled", "expired"]).describe(
    "expired: the run set expires_in and its model call had not started by then",
  ),
  output: z.unknown().optional().describe("The parsed JSON when the task has an output schema, else the text"),
  error: z.string().optional(),
  model: z.string().optional().describe("The model asked (a done run of a task)"),
  attempts: z.number().int().describe("Model calls made for this run so far (recorded within a second)"),
  tokens: z.object({ prompt: z.number().int(), completion: z.number().int() }),
  cost_usd: z.number().optional().describe(
    "What its calls were charged at the model's price (LLM_PRICES): the reported usage, or the reservation of a " +
      "call that timed out after it was sent; absent when the model has no price",
  ),
  waiting_for: z.enum(["budget", "provider", "batch"]).optional().describe(
    "Why a queued run is not running: its tenant's budget is spent (it goes on when the period ends or the " +
      "budget is raised)",
  ),
  cached: z.literal(true).optional().describe(
    "The output was reused from an earlier done run of the same task version, model and input (the result " +
      "cache): no model call, so no attempts and no tokens",
  ),
});
export type RunDocument = z.infer<typeof RunDocument>;
