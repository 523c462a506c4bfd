/**
 * The API process's OpenAPI document (`GET /openapi.json`): every area it mounts (summaries, tasks, runs, usage)
 * and its own paths, so it sits with the process that serves them all.
 */
import { z } from "zod";
import { IdempotencyKey, RunWebhook, SummaryRequest, SummaryStatus, SummaryWebhook } from "../runs/shapes.ts";
import { SummaryAccepted } from "../summaries/schemas.ts";
import { MAX_WAIT_S } from "../runs/job_waiter.ts";
import { DEFINITION_LIMITS, TaskDefinition, TaskDocument, TaskList } from "../tasks/definition.ts";
import { TASK_LIST } from "../tasks/api.ts";
import { RunAccepted, RunDocument, RunRequest } from "../runs/run_schemas.ts";
import { UsageDocument } from "../usage/usage_schemas.ts";
import { DEFAULT_SINCE, MAX_SINCE_S } from "../usage/since.ts";

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

/** The routes the API serves: the handler's router and this document both come from this list. */
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
  { method: "get", path: "/v1/usage" },
  { method: "get", path: "/healthz" },
  { method: "get", path: "/readyz" },
  { method: "get", path: "/metrics" },
  { method: "get", path: "/openapi.json" },
] as const;

const schema = (s: z.ZodType) => {
  const { $schema: _, ...rest } = z.toJSONSchema(s, { io: "input", unrepresentable: "any" }) as Record<string, unknown>;
  return rest;
};

const problem = (description: string, headers?: Record<string, unknown>) => ({
  description,
  ...(headers ? { headers } : {}),
  content: { "application/problem+json": { schema: { $ref: "#/components/schemas/Problem" } } },
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
/** The optional headers of a POST that starts a job or run. */
const POST_OPTIONS = [PREFER, CACHE_CONTROL];
const APPLIED = {
  "Preference-Applied": {
    schema: { type: "string" },
    description: "wait=N when the request asked to wait (also when the wait ran out)",
  },
  Vary: { schema: { type: "string", enum: ["prefer"] }, description: "Prefer changes this response" },
};
const JOB_ID = { name: "job_id", in: "path", required: true, schema: { type: "string", format: "uuid" } };
const RUN_ID = { name: "run_id", in: "path", required: true, schema: { type: "string", format: "uuid" } };

const json = (ref: string) => ({ "application/json": { schema: { $ref: `#/components/schemas/${ref}` } } });
const shared = (name: string) => ({ $ref: `#/components/responses/${name}` });
/** What any route may answer besides its own statuses. */
const ALWAYS = {
  "400": shared("BadRequest"),
  "405": shared("MethodNotAllowed"),
  "500": shared("InternalError"),
};

/** One webhook's description: `summary` says when it is sent, `body` names its schema. */
function webhook(operationId: string, summary: string, body: string) {
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
      requestBody: { required: true, content: json(body) },
      responses: { "2XX": { description: "Delivered" } },
    },
  };
}

/** The webhooks a job or run with `notify: {webhook}` sends. */
function summaryWebhooks() {
  return {
    "summary.ready": webhook(
      "summaryReady",
      'A summary job with notify {"webhook": URL} finished: sent to URL per Standard Webhooks',
      "SummaryWebhook",
    ),
    "run.completed": webhook(
      "runCompleted",
      'A run with notify {"webhook": URL} is done: its output, sent to URL per Standard Webhooks',
      "RunWebhook",
    ),
    "run.failed": webhook(
      "runFailed",
      'A run with notify {"webhook": URL} failed for good (dead-lettered): its error, per Standard Webhooks',
      "RunWebhook",
    ),
  };
}

/** The summary API's paths. */
function summaryPaths() {
  return {
    "/v1/summaries": {
      post: {
        operationId: "createSummary",
        summary: "Submit a document to summarise, at most once per Idempotency-Key",
        parameters: [{
          name: "Idempotency-Key",
          in: "header",
          required: true,
          schema: schema(IdempotencyKey),
          description: "16 to 128 visible ASCII characters; scoped to your tenant, method and path",
        }, ...POST_OPTIONS],
        requestBody: { required: true, content: json("SummaryRequest") },
        responses: {
          ...ALWAYS,
          "200": {
            description: "Prefer: wait=N and the job finished in time: its document, as GET returns it",
            headers: {
              ...APPLIED,
              Location: { schema: { type: "string" }, description: "The job's document" },
              "Idempotent-Replayed": { schema: { type: "string", enum: ["true"] } },
            },
            content: json("SummaryStatus"),
          },
          "202": {
            description: "Accepted (or a replay of the first response, with Idempotent-Replayed: true)",
            headers: {
              ...APPLIED,
              Location: { schema: { type: "string" }, description: "The job's document" },
              "Idempotent-Replayed": { schema: { type: "string", enum: ["true"] } },
            },
            content: json("SummaryAccepted"),
          },
          "400": problem("Missing or malformed Idempotency-Key, malformed JSON, or a malformed Host or target"),
          "401": problem("Missing or bad credentials"),
          "408": problem("The body did not arrive in time (the connection is closed)"),
          "413": problem("Body over MAX_BODY_BYTES"),
          "415": problem("Not JSON"),
          "422": problem(
            "Body failed validation, the key was used with another body, or the webhook URL was refused " +
              "(not https, a private address, credentials) or the tenant has no signing secret",
          ),
          "429": problem(
            "The tenant's budget is spent (title `Budget exhausted`, with `budget: {period, unit, limit, spent}`); " +
              "nothing was stored; Retry-After is the seconds until the budget's period ends",
            { "Retry-After": { schema: { type: "integer" } } },
          ),
          "503": problem("The queue, or the tenant's part of it, is over its cap", {
            "Retry-After": { schema: { type: "string" } },
          }),
          "500": problem("Not stored: retry with the same key"),
        },
      },
    },
    "/v1/summaries/{job_id}": {
      get: {
        operationId: "getSummary",
        summary: "A job's status, and its summary once done; optionally waits for it to finish",
        parameters: [JOB_ID, PREFER],
        responses: {
          ...ALWAYS,
          "200": { description: "The job's status", headers: APPLIED, content: json("SummaryStatus") },
          "401": problem("Missing or bad credentials"),
          "404": problem("Unknown job, or another tenant's"),
        },
      },
      delete: {
        operationId: "cancelSummary",
        summary: "Cancel a job that has not finished: it then makes no model call and has no effects",
        parameters: [JOB_ID],
        responses: {
          ...ALWAYS,
          "200": { description: "Cancelled (also when it already was)", content: json("SummaryStatus") },
          "401": problem("Missing or bad credentials"),
          "404": problem("Unknown job, or another tenant's"),
          "409": problem("The job is already done or failed"),
        },
      },
    },
  };
}

const TASK_NAME_PARAM = {
  name: "name",
  in: "path",
  required: true,
  schema: { type: "string", pattern: "^[a-z][a-z0-9_-]{0,63}$" },
};

/** The task definitions' paths. */
function taskPaths() {
  const unauthorized = problem("Missing or bad credentials");
  return {
    "/v1/tasks": {
      get: {
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
            schema: { type: "string", pattern: "^[a-z][a-z0-9_-]{0,63}$" },
            description: "The last task name of the page before (what `next` carries)",
          },
        ],
        responses: {
          ...ALWAYS,
          "200": { description: "One page of the tasks", content: json("TaskList") },
          "400": problem("limit or after out of bounds, or the query has another parameter"),
          "401": unauthorized,
        },
      },
    },
    "/v1/tasks/{name}": {
      get: {
        operationId: "getTask",
        summary: "A task's latest version",
        parameters: [TASK_NAME_PARAM],
        responses: {
          ...ALWAYS,
          "200": { description: "The task", content: json("Task") },
          "401": unauthorized,
          "404": problem("Unknown task, or another tenant's"),
        },
      },
      put: {
        operationId: "putTask",
        summary: "Define a task: a new version when the definition changed, the latest when it did not",
        parameters: [TASK_NAME_PARAM],
        requestBody: { required: true, content: json("TaskDefinition") },
        responses: {
          ...ALWAYS,
          "200": { description: "Identical to the latest version, which is returned", content: json("Task") },
          "201": {
            description: "Stored as a new version",
            headers: { Location: { schema: { type: "string" }, description: "The new version" } },
            content: json("Task"),
          },
          "401": unauthorized,
          "408": problem("The body did not arrive in time (the connection is closed)"),
          "409": problem(
            "summarize is built in and cannot be changed, or the tenant has 1,000 tasks or the task 1,000 versions, " +
              "or the new version would pass the bytes the tenant may store (TASK_TENANT_MAX_BYTES); nothing stored",
          ),
          "413": problem("Body over MAX_BODY_BYTES"),
          "415": problem("Not JSON"),
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
            { "Retry-After": { schema: { type: "integer" } } },
          ),
          "503": problem("Too many definitions are waiting to be checked", {
            "Retry-After": { schema: { type: "string" } },
          }),
        },
      },
    },
    "/v1/tasks/{name}/runs": {
      post: {
        operationId: "startRun",
        summary: "Run a task version on one input, at most once per Idempotency-Key",
        parameters: [TASK_NAME_PARAM, {
          name: "Idempotency-Key",
          in: "header",
          required: true,
          schema: schema(IdempotencyKey),
          description: "16 to 128 visible ASCII characters; scoped to your tenant, method and path (so per task)",
        }, ...POST_OPTIONS],
        requestBody: { required: true, content: json("RunRequest") },
        responses: {
          ...ALWAYS,
          "200": {
            description: "Prefer: wait=N and the run finished in time: its document, as GET returns it",
            headers: { ...APPLIED, "Idempotent-Replayed": { schema: { type: "string", enum: ["true"] } } },
            content: json("Run"),
          },
          "202": {
            description: "Accepted (or a replay of the first response, with Idempotent-Replayed: true)",
            headers: {
              ...APPLIED,
              Location: { schema: { type: "string" }, description: "The run's document, /v1/runs/{run_id}" },
              "Idempotent-Replayed": { schema: { type: "string", enum: ["true"] } },
            },
            content: json("RunAccepted"),
          },
          "401": unauthorized,
          "404": problem("Unknown task or version, or another tenant's"),
          "408": problem("The body did not arrive in time (the connection is closed)"),
          "409": problem("The same key's first request is still in progress", {
            "Retry-After": { schema: { type: "integer" } },
          }),
          "413": problem("Body over MAX_BODY_BYTES"),
          "415": problem("Not JSON"),
          "422": problem(
            "The body failed validation, or the input does not match the version's input schema: errors[].pointer " +
              "names the first failing place (/input/...); priority and expires_in are not available yet and are " +
              "refused; the key was used with another body",
          ),
          "429": problem(
            "The tenant's budget is spent (title `Budget exhausted`, with `budget: {period, unit, limit, spent}`); " +
              "nothing was stored; Retry-After is the seconds until the budget's period ends",
            { "Retry-After": { schema: { type: "integer" } } },
          ),
          "503": problem("The queue is full; nothing was stored", { "Retry-After": { schema: { type: "integer" } } }),
        },
      },
    },
    "/v1/runs/{run_id}": {
      get: {
        operationId: "getRun",
        summary: "A run's status, and its output once done (a summary job is a run of summarize); optionally waits",
        parameters: [RUN_ID, PREFER],
        responses: {
          ...ALWAYS,
          "200": { description: "The run", headers: APPLIED, content: json("Run") },
          "401": unauthorized,
          "404": problem("Unknown run, or another tenant's"),
        },
      },
      delete: {
        operationId: "cancelRun",
        summary: "Cancel a run that has not finished: it then makes no model call and has no effects",
        parameters: [RUN_ID],
        responses: {
          ...ALWAYS,
          "200": { description: "Cancelled (also when it already was)", content: json("Run") },
          "401": unauthorized,
          "404": problem("Unknown run, or another tenant's"),
          "409": problem("The run is already done or failed"),
        },
      },
    },
    "/v1/tasks/{name}/versions/{version}": {
      get: {
        operationId: "getTaskVersion",
        summary: "One version of a task",
        parameters: [TASK_NAME_PARAM, {
          name: "version",
          in: "path",
          required: true,
          schema: { type: "integer", minimum: 1 },
        }],
        responses: {
          ...ALWAYS,
          "200": { description: "The version", content: json("Task") },
          "401": unauthorized,
          "404": problem("Unknown task or version, or another tenant's"),
        },
      },
    },
  };
}

/** The usage report's path. */
function usagePaths() {
  return {
    "/v1/usage": {
      get: {
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
          ...ALWAYS,
          "200": { description: "The report", content: json("Usage") },
          "400": problem("since is not a number and a unit within bounds, or the query has another parameter"),
          "401": problem("Missing or bad credentials"),
        },
      },
    },
  };
}

/** The service's own paths: health, readiness, metrics and this document. */
function servicePaths() {
  return {
    "/healthz": {
      get: {
        operationId: "healthz",
        summary: "Liveness: the process answers",
        security: [],
        responses: { ...ALWAYS, "200": { description: "The process is alive" } },
      },
    },
    "/readyz": {
      get: {
        operationId: "readyz",
        summary: "Readiness: Redis and Postgres answer",
        security: [],
        responses: {
          ...ALWAYS,
          "200": { description: "Redis and Postgres answer" },
          "503": { description: "Redis or Postgres does not answer" },
        },
      },
    },
    "/metrics": {
      get: {
        operationId: "metrics",
        summary: "Prometheus metrics (behind METRICS_TOKEN as a bearer token when it is set)",
        security: [{}, { metricsToken: [] }],
        responses: {
          ...ALWAYS,
          "200": { description: "Prometheus text format", content: { "text/plain": {} } },
          "401": problem("METRICS_TOKEN is set and the bearer token is missing or wrong"),
          "404": problem("Metrics are not enabled in this process"),
        },
      },
    },
    "/openapi.json": {
      get: {
        operationId: "openapi",
        summary: "This document",
        security: [],
        responses: { ...ALWAYS, "200": { description: "This document", content: { "application/json": {} } } },
      },
    },
  };
}

/**
 * The OpenAPI 3.1 document of the HTTP API, generated from the same zod
 * schemas that validate requests.
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
        BadRequest: problem("Malformed request: a Host header or target that is not a valid URL"),
        MethodNotAllowed: problem("This path does not serve that method", {
          Allow: { schema: { type: "string" }, description: "The methods this path serves" },
        }),
        InternalError: problem("The server could not complete the request; nothing was stored"),
      },
      securitySchemes: {
        apiKey: { type: "http", scheme: "bearer", description: "A key from `deno task tenant create`" },
        metricsToken: { type: "http", scheme: "bearer", description: "METRICS_TOKEN, when it is set" },
      },
      schemas: {
        SummaryRequest: schema(SummaryRequest),
        TaskDefinition: schema(TaskDefinition),
        Task: schema(TaskDocument),
        TaskList: schema(TaskList),
        Run: schema(RunDocument),
        RunRequest: schema(RunRequest),
        RunAccepted: schema(RunAccepted),
        RunWebhook: schema(RunWebhook),
        SummaryAccepted: schema(SummaryAccepted),
        SummaryStatus: schema(SummaryStatus),
        SummaryWebhook: schema(SummaryWebhook),
        Usage: schema(UsageDocument),
        Problem: schema(Problem),
      },
    },
    security: [{ apiKey: [] }],
    webhooks: summaryWebhooks(),
    paths: { ...summaryPaths(), ...taskPaths(), ...usagePaths(), ...servicePaths() },
  };
}
