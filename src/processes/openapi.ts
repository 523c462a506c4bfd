/**
 * The API process's OpenAPI document (`GET /openapi.json`): every area it mounts (summaries, tasks, runs, usage)
 * and its own paths, so it sits with the process that serves them all.
 *
 * The paths are data: a table of routes ({@linkcode Route}), each naming the zod schemas of its body and of its
 * answers, which one small generator (`operation`) turns into OpenAPI, with the schemas as components.
 */
import { z } from "zod";
import { IdempotencyKey, RunWebhook, SummaryRequest, SummaryStatus, SummaryWebhook } from "../runs/shapes.ts";
import { SummaryAccepted } from "../summaries/schemas.ts";
import { MAX_WAIT_S } from "../runs/job_waiter.ts";
import { DEFINITION_LIMITS, TASK_NAME, TaskDefinition, TaskDocument, TaskList } from "../tasks/definition.ts";
import { TASK_LIST } from "../tasks/api.ts";
import { RunAccepted, RunDocument, RunRequest } from "../runs/run_schemas.ts";
import { UsageDocument } from "../usage/usage_schemas.ts";
import { DEFAULT_SINCE, MAX_SINCE_S } from "../usage/since.ts";
import { KEEPALIVE_MS } from "../openai_compat/openai_api.ts";

/** An RFC 9457 problem document. */
export const Problem = z.object({
  type: z.string(),
  title: z.string(),
  status: z.number().int(),
  detail: z.string(),
  errors: z.array(z.object({
    path: z.string().optional().describe("The field, dot-separated (summaries)"),
    pointer: z.string().optional().describe("A JSON pointer into the body (tasks)"),
    message: z.string(),
  })).optional(),
});

/** An error in OpenAI's shape, on the OpenAI-compatible paths only. */
export const OpenAIError = z.object({
  error: z.object({
    message: z.string(),
    type: z.string(),
    param: z.string().nullable(),
    code: z.string().nullable().describe("model_not_found, run_pending, budget_exhausted, run_failed, ..."),
  }),
});

/** An OpenAI request or answer body (Chat Completions, Responses), described by OpenAI's own API reference. */
const OPENAI_BODY = z.record(z.string(), z.unknown());

/**
 * The routes the API serves, listed apart from the document: a test checks that the handler serves each of them
 * and that the document describes exactly these.
 */
export const ROUTES = [
  { method: "post", path: "/v1/summaries" },
  { method: "get", path: "/v1/summaries/{job_id}" },
  { method: "delete", path: "/v1/summaries/{job_id}" },
  { method: "get", path: "/v1/tasks" },
  { method: "get", path: "/v1/tasks/{name}" },
  { method: "put", path: "/v1/tasks/{name}" },
  { method: "get", path: "/v1/tasks/{name}/versions/{version}" },
  { method: "post", path: "/v1/tasks/{name}/runs" },
  { method: "get", path: "/v1/runs/{run_id}" },
  { method: "delete", path: "/v1/runs/{run_id}" },
  { method: "post", path: "/v1/chat/completions" },
  { method: "post", path: "/v1/responses" },
  { method: "get", path: "/v1/responses/{response_id}" },
  { method: "post", path: "/v1/responses/{response_id}/cancel" },
  { method: "get", path: "/v1/usage" },
  { method: "get", path: "/healthz" },
  { method: "get", path: "/readyz" },
  { method: "get", path: "/metrics" },
  { method: "get", path: "/openapi.json" },
] as const;

/** The document's schemas (`components.schemas`), by name: a route names a body by its zod schema, one of these. */
const SCHEMAS: Record<string, z.ZodType> = {
  SummaryRequest,
  TaskDefinition,
  Task: TaskDocument,
  TaskList,
  Run: RunDocument,
  RunRequest,
  RunAccepted,
  RunWebhook,
  SummaryAccepted,
  SummaryStatus,
  SummaryWebhook,
  Usage: UsageDocument,
  Problem,
  OpenAIError,
  OpenAIBody: OPENAI_BODY,
};

/** An OpenAPI header, parameter or schema object, as it appears in the document. */
type Spec = Record<string, unknown>;

/** One answer of a route. */
interface Reply {
  description: string;
  headers?: Record<string, Spec>;
  /** The body's zod schema, one of {@linkcode SCHEMAS}: JSON, or a problem document for {@linkcode Problem}. */
  body?: z.ZodType;
  /** A body of this media type that the document does not describe further (with no `body`). */
  media?: string;
  /** The answer may instead be a `text/event-stream` (`stream: true`), which `description` describes. */
  events?: boolean;
}

/** One operation of the API, as the document describes it; {@linkcode operation} turns it into OpenAPI. */
interface Route {
  method: (typeof ROUTES)[number]["method"];
  path: string;
  operationId: string;
  summary: string;
  description?: string;
  /** Unset: the document's own (an API key). */
  security?: Record<string, string[]>[];
  parameters?: Spec[];
  /** The JSON body's zod schema, one of {@linkcode SCHEMAS}; a route with one requires it. */
  request?: z.ZodType;
  /** By status, besides those every route may answer ({@linkcode ALWAYS}), which a route may describe again. */
  responses: Record<string, Reply>;
}

const schema = (s: z.ZodType) => {
  const { $schema: _, ...rest } = z.toJSONSchema(s, { io: "input", unrepresentable: "any" }) as Record<string, unknown>;
  return rest;
};

const problem = (description: string, headers?: Record<string, Spec>): Reply => ({
  description,
  ...(headers ? { headers } : {}),
  body: Problem,
});

/** `Prefer: wait=N` (RFC 7240), on POST and GET. */
const PREFER = {
  name: "Prefer",
  in: "header",
  required: false,
  schema: { type: "string", examples: ["wait=10"] },
  description: `wait=N (N at most ${MAX_WAIT_S}): answer 200 with the finished job's document if it finishes ` +
    "within N seconds, with Preference-Applied: wait=N; otherwise the usual answer",
};
/** `Cache-Control: no-cache` on a POST: the job or run skips the result cache's lookup. */
const CACHE_CONTROL = {
  name: "Cache-Control",
  in: "header",
  required: false,
  schema: { type: "string", examples: ["no-cache"] },
  description: "no-cache: do not reuse an earlier identical result (the result cache, on when the task version's " +
    "cache_ttl_s or RESULT_CACHE_TTL_S is above 0); the model is called, and its result may be reused later",
};
/** A POST's headers: its `Idempotency-Key` (`scope` adds to what it is scoped to), then the optional ones. */
const postHeaders = (scope: string): Spec[] => [
  {
    name: "Idempotency-Key",
    in: "header",
    required: true,
    schema: schema(IdempotencyKey),
    description: `16 to 128 visible ASCII characters; scoped to your tenant, method and path${scope}`,
  },
  PREFER,
  CACHE_CONTROL,
];
const APPLIED = {
  "Preference-Applied": {
    schema: { type: "string" },
    description: "wait=N when the request asked to wait (also when the wait ran out)",
  },
  Vary: { schema: { type: "string", enum: ["prefer"] }, description: "Prefer changes this response" },
};
const REPLAYED = { "Idempotent-Replayed": { schema: { type: "string", enum: ["true"] } } };
const location = (description: string) => ({ Location: { schema: { type: "string" }, description } });
const retryAfter = (type: "integer" | "string") => ({ "Retry-After": { schema: { type } } });
const JOB_ID = { name: "job_id", in: "path", required: true, schema: { type: "string", format: "uuid" } };
const RUN_ID = { name: "run_id", in: "path", required: true, schema: { type: "string", format: "uuid" } };
const TASK_NAME_PARAM = {
  name: "name",
  in: "path",
  required: true,
  schema: { type: "string", pattern: TASK_NAME.source },
};

const UNAUTHORIZED = problem("Missing or bad credentials");
const BODY_LATE = problem("The body did not arrive in time (the connection is closed)");
const TOO_LARGE = problem("Body over MAX_BODY_BYTES");
const NOT_JSON = problem("Not JSON");
const OVER_BUDGET = problem(
  "The tenant's budget is spent (title `Budget exhausted`, with `budget: {period, unit, limit, spent}`); " +
    "nothing was stored; Retry-After is the seconds until the budget's period ends",
  retryAfter("integer"),
);

/** `/v1/summaries`: a summary job is a run of the built-in `summarize`, with an email or a webhook. */
const SUMMARY_ROUTES: Route[] = [{
  method: "post",
  path: "/v1/summaries",
  operationId: "createSummary",
  summary: "Submit a document to summarise, at most once per Idempotency-Key",
  parameters: postHeaders(""),
  request: SummaryRequest,
  responses: {
    "200": {
      description: "Prefer: wait=N and the job finished in time: its document, as GET returns it",
      headers: { ...APPLIED, ...location("The job's document"), ...REPLAYED },
      body: SummaryStatus,
    },
    "202": {
      description: "Accepted (or a replay of the first response, with Idempotent-Replayed: true)",
      headers: { ...APPLIED, ...location("The job's document"), ...REPLAYED },
      body: SummaryAccepted,
    },
    "400": problem("Missing or malformed Idempotency-Key, malformed JSON, or a malformed Host or target"),
    "401": UNAUTHORIZED,
    "408": BODY_LATE,
    "413": TOO_LARGE,
    "415": NOT_JSON,
    "422": problem(
      "Body failed validation, the key was used with another body, or the webhook URL was refused " +
        "(not https, a private address, credentials) or the tenant has no signing secret",
    ),
    "429": OVER_BUDGET,
    "503": problem(
      "The queue, or the tenant's part of it, is over its cap; or the tenant's request bodies being read are over " +
        "its share (TENANT_BODY_BYTES_IN_FLIGHT): nothing was stored",
      retryAfter("string"),
    ),
    "500": problem("Not stored: retry with the same key"),
  },
}, {
  method: "get",
  path: "/v1/summaries/{job_id}",
  operationId: "getSummary",
  summary: "A job's status, and its summary once done; optionally waits for it to finish",
  parameters: [JOB_ID, PREFER],
  responses: {
    "200": { description: "The job's status", headers: APPLIED, body: SummaryStatus },
    "401": UNAUTHORIZED,
    "404": problem("Unknown job, or another tenant's"),
  },
}, {
  method: "delete",
  path: "/v1/summaries/{job_id}",
  operationId: "cancelSummary",
  summary: "Cancel a job that has not finished: it then makes no model call and has no effects",
  parameters: [JOB_ID],
  responses: {
    "200": { description: "Cancelled (also when it already was)", body: SummaryStatus },
    "401": UNAUTHORIZED,
    "404": problem("Unknown job, or another tenant's"),
    "409": problem("The job is already done or failed"),
  },
}];

/** The task definitions' routes. */
const TASK_ROUTES: Route[] = [{
  method: "get",
  path: "/v1/tasks",
  operationId: "listTasks",
  summary: "Your tasks, each with its latest version (number, time, size; no definition), a page at a time",
  description: "By name, the first page starting with the built-in summarize; `next` is the next page's path, " +
    "null on the last. Read a definition with GET /v1/tasks/{name}.",
  parameters: [
    {
      name: "limit",
      in: "query",
      required: false,
      schema: { type: "integer", minimum: 1, maximum: TASK_LIST.maxLimit, default: TASK_LIST.defaultLimit },
      description: "Tasks per page (summarize, on the first page, is not counted)",
    },
    {
      name: "after",
      in: "query",
      required: false,
      schema: { type: "string", pattern: TASK_NAME.source },
      description: "The last task name of the page before (what `next` carries)",
    },
  ],
  responses: {
    "200": { description: "One page of the tasks", body: TaskList },
    "400": problem("limit or after out of bounds, or the query has another parameter"),
    "401": UNAUTHORIZED,
  },
}, {
  method: "get",
  path: "/v1/tasks/{name}",
  operationId: "getTask",
  summary: "A task's latest version",
  parameters: [TASK_NAME_PARAM],
  responses: {
    "200": { description: "The task", body: TaskDocument },
    "401": UNAUTHORIZED,
    "404": problem("Unknown task, or another tenant's"),
  },
}, {
  method: "put",
  path: "/v1/tasks/{name}",
  operationId: "putTask",
  summary: "Define a task: a new version when the definition changed, the latest when it did not",
  parameters: [TASK_NAME_PARAM],
  request: TaskDefinition,
  responses: {
    "200": { description: "Identical to the latest version, which is returned", body: TaskDocument },
    "201": { description: "Stored as a new version", headers: location("The new version"), body: TaskDocument },
    "400": problem("Malformed JSON, or a malformed Host or target"),
    "401": UNAUTHORIZED,
    "408": BODY_LATE,
    "409": problem(
      "summarize is built in and cannot be changed, or the tenant has 1,000 tasks or the task 1,000 versions, " +
        "or the new version would pass the bytes the tenant may store (TASK_TENANT_MAX_BYTES); nothing stored",
    ),
    "413": TOO_LARGE,
    "415": NOT_JSON,
    "422": problem(
      "Not a task name, or the definition failed validation: errors[].pointer names the place (a schema " +
        `over 64 KiB, the whole over ${DEFINITION_LIMITS.maxBytes} bytes of JSON, not JSON Schema 2020-12, ` +
        "referring to another document or with a pattern that could backtrack without bound; a placeholder " +
        "naming no declared input property; a check that took longer than its deadline)",
    ),
    "429": problem(
      "The tenant stored new versions faster than TASK_PUTS_PER_MINUTE (TASK_PUT_BURST at once): until a " +
        "token is back every PUT is refused (nothing stored); Retry-After is the seconds until then. A PUT " +
        "identical to the latest version takes no token",
      retryAfter("integer"),
    ),
    "503": problem("Too many definitions are waiting to be checked", retryAfter("string")),
  },
}, {
  method: "get",
  path: "/v1/tasks/{name}/versions/{version}",
  operationId: "getTaskVersion",
  summary: "One version of a task",
  parameters: [TASK_NAME_PARAM, {
    name: "version",
    in: "path",
    required: true,
    schema: { type: "integer", minimum: 1 },
  }],
  responses: {
    "200": { description: "The version", body: TaskDocument },
    "401": UNAUTHORIZED,
    "404": problem("Unknown task or version, or another tenant's"),
  },
}];

/** The runs' routes: a run of any task, and a summary job's too. */
const RUN_ROUTES: Route[] = [{
  method: "post",
  path: "/v1/tasks/{name}/runs",
  operationId: "startRun",
  summary: "Run a task version on one input, at most once per Idempotency-Key",
  parameters: [TASK_NAME_PARAM, ...postHeaders(" (so per task)")],
  request: RunRequest,
  responses: {
    "200": {
      description: "Prefer: wait=N and the run finished in time: its document, as GET returns it",
      headers: { ...APPLIED, ...REPLAYED },
      body: RunDocument,
    },
    "202": {
      description: "Accepted (or a replay of the first response, with Idempotent-Replayed: true)",
      headers: { ...APPLIED, ...location("The run's document, /v1/runs/{run_id}"), ...REPLAYED },
      body: RunAccepted,
    },
    "400": problem("Missing or malformed Idempotency-Key, malformed JSON, or a malformed Host or target"),
    "401": UNAUTHORIZED,
    "404": problem("Unknown task or version, or another tenant's"),
    "408": BODY_LATE,
    "409": problem(
      "The version's input schema cannot be compiled by this release (stored under an earlier release's rules): " +
        "PUT a new version",
    ),
    "413": TOO_LARGE,
    "415": NOT_JSON,
    "422": problem(
      "The body failed validation, or the input does not match the version's input schema: errors[].pointer " +
        "names the first failing place (/input/..., or /expires_in above 604800 s); the key was used with " +
        "another body (a different priority or expires_in included)",
    ),
    "429": OVER_BUDGET,
    "503": problem(
      "The queue is full, the input cannot be validated now, or the tenant's request bodies being read are over " +
        "its share (TENANT_BODY_BYTES_IN_FLIGHT); nothing was stored",
      retryAfter("integer"),
    ),
  },
}, {
  method: "get",
  path: "/v1/runs/{run_id}",
  operationId: "getRun",
  summary: "A run's status, and its output once done (a summary job is a run of summarize); optionally waits",
  parameters: [RUN_ID, PREFER],
  responses: {
    "200": { description: "The run", headers: APPLIED, body: RunDocument },
    "401": UNAUTHORIZED,
    "404": problem("Unknown run, or another tenant's"),
  },
}, {
  method: "delete",
  path: "/v1/runs/{run_id}",
  operationId: "cancelRun",
  summary: "Cancel a run that has not finished: it then makes no model call and has no effects",
  parameters: [RUN_ID],
  responses: {
    "200": { description: "Cancelled (also when it already was)", body: RunDocument },
    "401": UNAUTHORIZED,
    "404": problem("Unknown run, or another tenant's"),
    "409": problem("The run is already done, failed or expired"),
  },
}];

const openAiError = (description: string, headers?: Record<string, Spec>): Reply => ({
  description,
  ...(headers ? { headers } : {}),
  body: OpenAIError,
});
const RUN_HEADER = { "Oncely-Run-Id": { schema: { type: "string", format: "uuid" }, description: "The run" } };
const OPTIONAL_KEY = {
  name: "Idempotency-Key",
  in: "header",
  required: false,
  schema: schema(IdempotencyKey),
  description: "Optional: the same key and body answer the same result, with no second model call",
};
const LONG_WAIT = {
  ...PREFER,
  description: "wait=N (N at most 600): how long to wait for the run; OPENAI_COMPAT_WAIT_S when unset",
};
const PENDING = openAiError(
  "The run did not finish within the wait (code run_pending); it goes on. x-should-retry: true with an " +
    "Idempotency-Key (a retry waits again for the same run), false without",
  { ...RUN_HEADER, ...retryAfter("integer"), "x-should-retry": { schema: { type: "string" } } },
);
const RESPONSE_ID = { name: "response_id", in: "path", required: true, schema: { type: "string" } };
const SHOULD_RETRY = (description: string) => ({ "x-should-retry": { schema: { type: "string" }, description } });
/** The answers of both POSTs (a chat completion, a response) that are not about what the run did. */
const OPENAI_POST_ERRORS: Record<string, Reply> = {
  "401": openAiError("Missing or bad API key"),
  "404": openAiError("The model is not served here (code model_not_found)"),
  "413": openAiError("Body over MAX_BODY_BYTES; nothing was stored"),
  "415": openAiError("Content-Type is not application/json; nothing was stored"),
  "429": openAiError("The tenant's budget is spent (code budget_exhausted, x-should-retry: false)"),
  "503": openAiError(
    "The queue, or the tenant's part of it, is over its cap, or the tenant's request bodies being read are over " +
      "its share (TENANT_BODY_BYTES_IN_FLIGHT): nothing was stored. Or too few replicas acknowledged the run " +
      "(REDIS_MIN_REPLICAS_ACK): it may be recorded, so without an Idempotency-Key x-should-retry is false",
    { ...retryAfter("integer"), ...SHOULD_RETRY("false when a retry without a key could start a second run") },
  ),
  "500": openAiError(
    "The server could not complete the request. Once the run is accepted, Oncely-Run-Id names it; without an " +
      "Idempotency-Key, x-should-retry is false whenever the run may have been recorded",
    { ...RUN_HEADER, ...SHOULD_RETRY("false when a retry without a key could start a second run") },
  ),
};
/** A POST's 400: `failed` says what else than a malformed request it may be. */
const openAiBadRequest = (failed: string) =>
  openAiError(
    "A malformed Idempotency-Key (param Idempotency-Key), or a body that is not a JSON object (empty, not UTF-8, " +
      `not JSON, a key twice): nothing was stored. Or ${failed} (code run_failed, x-should-retry: false, ` +
      "Oncely-Run-Id; the message is the failure's class, the provider's text is withheld)",
    { ...RUN_HEADER, ...SHOULD_RETRY("false for run_failed") },
  );
/** A POST's 408: the run did not finish in time, or the body did not arrive in time. */
const OPENAI_POST_408 = {
  ...PENDING,
  description: `${PENDING.description}. Or the body did not arrive in time (the connection is closed)`,
};
/** What the GET and the cancel of a response may answer. */
const OPENAI_READ_ERRORS: Record<string, Reply> = {
  "401": openAiError("Missing or bad API key"),
  "404": openAiError("Unknown response, or another tenant's"),
  "500": openAiError("The server could not complete the request"),
};

/**
 * The OpenAI-compatible routes: each request is a run of the built-in chat task; bodies and answers are
 * OpenAI's (see README, "Use it from the OpenAI SDK").
 */
const OPENAI_ROUTES: Route[] = [{
  method: "post",
  path: "/v1/chat/completions",
  operationId: "createChatCompletion",
  summary: "An OpenAI Chat Completions request, run as a run of the built-in chat task",
  parameters: [OPTIONAL_KEY, LONG_WAIT],
  request: OPENAI_BODY,
  responses: {
    "200": {
      description: "A chat.completion. With stream: true, text/event-stream at once: SSE comments (`: ...`) at " +
        `least every ${KEEPALIVE_MS / 1000} s while the run waits, then chat.completion.chunk events (the role, ` +
        "the content, the finish_reason), a usage chunk with stream_options.include_usage, and data: [DONE]; or, " +
        "if the run does not end done within the wait, one data: event holding an error in OpenAI's shape (code " +
        "run_pending, run_failed, ...) and no [DONE]",
      headers: { ...RUN_HEADER, ...REPLAYED },
      body: OPENAI_BODY,
      events: true,
    },
    "400": openAiBadRequest("the run failed for good"),
    ...OPENAI_POST_ERRORS,
    "408": OPENAI_POST_408,
    "409": openAiError(
      "The run was cancelled (DELETE /v1/runs/{run_id}) or expired before it was done (code run_cancelled or " +
        "run_expired, x-should-retry: false, Oncely-Run-Id)",
      { ...RUN_HEADER, ...SHOULD_RETRY("false") },
    ),
    "422": openAiError("An unsupported field (tools, n > 1, audio, images, logprobs), or the key with another body"),
  },
}, {
  method: "post",
  path: "/v1/responses",
  operationId: "createResponse",
  summary: "An OpenAI Responses request; background: true answers at once",
  parameters: [OPTIONAL_KEY, LONG_WAIT],
  request: OPENAI_BODY,
  responses: {
    "200": { description: "A response object", headers: { ...RUN_HEADER, ...REPLAYED }, body: OPENAI_BODY },
    "400": openAiBadRequest("without background, the run failed for good"),
    ...OPENAI_POST_ERRORS,
    "408": OPENAI_POST_408,
    "422": openAiError("An unsupported field (stream among them), or the key with another body"),
  },
}, {
  method: "get",
  path: "/v1/responses/{response_id}",
  operationId: "getResponse",
  summary: "A response: queued, in_progress, completed, failed, cancelled or incomplete",
  parameters: [RESPONSE_ID],
  responses: {
    "200": {
      description: "The response object; once completed, with the background, instructions and metadata its " +
        "create carried",
      body: OPENAI_BODY,
    },
    ...OPENAI_READ_ERRORS,
  },
}, {
  method: "post",
  path: "/v1/responses/{response_id}/cancel",
  operationId: "cancelResponse",
  summary: "Cancel a response's run as DELETE /v1/runs/{run_id} does; a finished one is answered as it is",
  parameters: [RESPONSE_ID],
  responses: { "200": { description: "The response object", body: OPENAI_BODY }, ...OPENAI_READ_ERRORS },
}];

/** The usage report's route. */
const USAGE_ROUTES: Route[] = [{
  method: "get",
  path: "/v1/usage",
  operationId: "getUsage",
  summary: "Your own model calls, tokens, cost, cache hits and budgets, in total, by task version and by model",
  parameters: [{
    name: "since",
    in: "query",
    required: false,
    schema: { type: "string", pattern: "^[0-9]{1,9}[smhd]$", default: DEFAULT_SINCE, examples: ["7d"] },
    description: `How far back: a number and a unit (s, m, h, d), 1s to ${MAX_SINCE_S / 86_400}d`,
  }],
  responses: {
    "200": { description: "The report", body: UsageDocument },
    "400": problem("since is not a number and a unit within bounds, or the query has another parameter"),
    "401": UNAUTHORIZED,
  },
}];

/** The service's own routes: health, readiness, metrics and this document. */
const SERVICE_ROUTES: Route[] = [{
  method: "get",
  path: "/healthz",
  operationId: "healthz",
  summary: "Liveness: the process answers",
  security: [],
  responses: { "200": { description: "The process is alive" } },
}, {
  method: "get",
  path: "/readyz",
  operationId: "readyz",
  summary: "Readiness: Redis and Postgres answer",
  security: [],
  responses: {
    "200": { description: "Redis and Postgres answer" },
    "503": { description: "Redis or Postgres does not answer" },
  },
}, {
  method: "get",
  path: "/metrics",
  operationId: "metrics",
  summary: "Prometheus metrics (behind METRICS_TOKEN as a bearer token when it is set)",
  security: [{}, { metricsToken: [] }],
  responses: {
    "200": { description: "Prometheus text format", media: "text/plain" },
    "401": problem("METRICS_TOKEN is set and the bearer token is missing or wrong"),
    "404": problem("Metrics are not enabled in this process"),
  },
}, {
  method: "get",
  path: "/openapi.json",
  operationId: "openapi",
  summary: "This document",
  security: [],
  responses: { "200": { description: "This document", media: "application/json" } },
}];

/** Every route of the document, in its order. */
const DOCUMENTED: readonly Route[] = [
  ...SUMMARY_ROUTES,
  ...TASK_ROUTES,
  ...RUN_ROUTES,
  ...OPENAI_ROUTES,
  ...USAGE_ROUTES,
  ...SERVICE_ROUTES,
];

/** The names of {@linkcode SCHEMAS}, by schema. */
const SCHEMA_NAMES = new Map(Object.entries(SCHEMAS).map(([name, s]) => [s, name]));

/** A reference to `s`'s component. @throws {TypeError} for a schema that is not one of {@linkcode SCHEMAS}. */
function ref(s: z.ZodType): { $ref: string } {
  const name = SCHEMA_NAMES.get(s);
  if (name === undefined) throw new TypeError("A route names a zod schema that is not one of the document's SCHEMAS");
  return { $ref: `#/components/schemas/${name}` };
}

/** A reply as OpenAPI: its description, headers and content. */
function response({ description, headers, body, media, events }: Reply): Spec {
  const content = body
    ? { [body === Problem ? "application/problem+json" : "application/json"]: { schema: ref(body) } }
    : media
    ? { [media]: {} }
    : undefined;
  // OpenAPI 3.1 has no schema for the events of a stream (3.2's itemSchema): the media type alone.
  const streamed = events ? { ...content, "text/event-stream": {} } : content;
  return { description, ...(headers ? { headers } : {}), ...(streamed ? { content: streamed } : {}) };
}

/** What any route may answer besides its own statuses. */
const ALWAYS = {
  "400": { $ref: "#/components/responses/BadRequest" },
  "405": { $ref: "#/components/responses/MethodNotAllowed" },
  "500": { $ref: "#/components/responses/InternalError" },
};

/** A route as an OpenAPI operation. */
function operation(route: Route): Spec {
  const { operationId, summary, description, security, parameters, request } = route;
  return {
    operationId,
    summary,
    ...(description === undefined ? {} : { description }),
    ...(security === undefined ? {} : { security }),
    ...(parameters === undefined ? {} : { parameters }),
    ...(request === undefined
      ? {}
      : { requestBody: { required: true, content: { "application/json": { schema: ref(request) } } } }),
    responses: {
      ...ALWAYS,
      ...Object.fromEntries(Object.entries(route.responses).map(([status, reply]) => [status, response(reply)])),
    },
  };
}

/** The document's `paths`: each route's operation under its path. */
function paths(routes: readonly Route[]): Record<string, Record<string, Spec>> {
  const byPath: Record<string, Record<string, Spec>> = {};
  for (const route of routes) (byPath[route.path] ??= {})[route.method] = operation(route);
  return byPath;
}

/** One webhook's description: `summary` says when it is sent, `body` is its zod schema. */
function webhook(operationId: string, summary: string, body: z.ZodType) {
  return {
    post: {
      operationId,
      summary,
      description: "Signed with the tenant's secret (whsec_...): webhook-signature is `v1,` + base64 " +
        "HMAC-SHA256 of `webhook-id.webhook-timestamp.body`; during a rotation two signatures, space-separated. " +
        "2xx is delivered; 408, 429 and 5xx are retried (Retry-After honoured) with the same webhook-id; " +
        "redirects are not followed; any other 4xx fails the delivery.",
      security: [],
      parameters: [
        { name: "webhook-id", in: "header", required: true, schema: { type: "string" } },
        { name: "webhook-timestamp", in: "header", required: true, schema: { type: "string" } },
        { name: "webhook-signature", in: "header", required: true, schema: { type: "string" } },
      ],
      requestBody: { required: true, content: { "application/json": { schema: ref(body) } } },
      responses: { "2XX": { description: "Delivered" } },
    },
  };
}

/** The webhooks a job or run with `notify: {webhook}` sends. */
function webhooks() {
  return {
    "summary.ready": webhook(
      "summaryReady",
      'A summary job with notify {"webhook": URL} finished: sent to URL per Standard Webhooks',
      SummaryWebhook,
    ),
    "run.completed": webhook(
      "runCompleted",
      'A run with notify {"webhook": URL} is done: its output, sent to URL per Standard Webhooks',
      RunWebhook,
    ),
    "run.failed": webhook(
      "runFailed",
      'A run with notify {"webhook": URL} failed for good (dead-lettered): its error, per Standard Webhooks',
      RunWebhook,
    ),
    "run.expired": webhook(
      "runExpired",
      'A run with notify {"webhook": URL} and expires_in expired: its model call had not started by then, so ' +
        "it made none; sent per Standard Webhooks",
      RunWebhook,
    ),
  };
}

/**
 * The OpenAPI 3.1 document of the HTTP API, generated from the same
 * zod schemas that validate requests.
 */
export function openApiDocument(): Record<string, unknown> {
  return {
    openapi: "3.1.0",
    info: {
      title: "Oncely",
      version: "1.0.0",
      description: "LLM tasks and summarisation jobs accepted at most once per Idempotency-Key, with " +
        "exactly-once effects. " +
        "A method this server does not implement at all (not one of RFC 9110's, nor PATCH) on an unknown path " +
        "is answered 501.",
    },
    servers: [{ url: "/", description: "This server" }],
    components: {
      responses: {
        BadRequest: response(problem("Malformed request: a Host header or target that is not a valid URL")),
        MethodNotAllowed: response(problem("This path does not serve that method", {
          Allow: { schema: { type: "string" }, description: "The methods this path serves" },
        })),
        InternalError: response(problem("The server could not complete the request; nothing was stored")),
      },
      securitySchemes: {
        apiKey: { type: "http", scheme: "bearer", description: "A key from `deno task tenant create`" },
        metricsToken: { type: "http", scheme: "bearer", description: "METRICS_TOKEN, when it is set" },
      },
      schemas: Object.fromEntries(Object.entries(SCHEMAS).map(([name, s]) => [name, schema(s)])),
    },
    security: [{ apiKey: [] }],
    webhooks: webhooks(),
    paths: paths(DOCUMENTED),
  };
}
