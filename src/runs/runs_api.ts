/**
 * Runs: `POST /v1/tasks/{name}/runs` starts one, `GET /v1/runs/{run_id}`
 * reads it and `DELETE /v1/runs/{run_id}` cancels it. A run goes through the
 * summary jobs' intake, lanes, worker, commit and outbox; every summary job
 * is a run of the built-in `summarize` task, so its id works here too.
 */
import { readJsonBody } from "../http/body.ts";
import { HttpError } from "../http/problem.ts";
import { json, Router } from "../http/router.ts";
import {
  answerSubmission,
  budgetRefusal,
  cancelJobOf,
  checkNotify,
  FINISHED,
  idempotencyKeyFrom,
  type RunHttpDeps,
  waitIfPreferred,
  withBodyAdmitted,
} from "./http.ts";
import { jobDocument, type JobFound } from "./job_document.ts";
import { currentTraceparent } from "../tracing.ts";
import { RENDER_LIMITS, renderedChars, renderTemplate, TASK_NAME } from "../tasks/definition.ts";
import { SchemaRefused, type SchemaViolation, unstorableJson } from "../tasks/json_schema.ts";
import { ValidationBusy, ValidationTimeout, ValidationTooCostly } from "../tasks/validator.ts";
import type { RunPayload } from "./run_payload.ts";
import { skipsCache } from "../cache/result_cache.ts";
import { parseRunRequest, type RunDocument, type RunRequest } from "./run_schemas.ts";
import type { TaskCache } from "../tasks/task_cache.ts";
import { CHAT_TASK } from "../tasks/chat_task.ts";

/** What the run routes need beyond the summary API's. */
export interface RunApiDeps extends RunHttpDeps {
  tasks: TaskCache;
  /** Validates an input against a task's input schema, compiled once per `key`. */
  validate: (key: string, schema: unknown, instance: unknown, tenant?: string) => Promise<SchemaViolation[]>;
  /** The same without a wait when the validation is small (`SchemaValidators.validateNow`); undefined otherwise. */
  validateNow?: (key: string, schema: unknown, instance: unknown, units?: number) => SchemaViolation[] | undefined;
}

const RUN_PATH = /^\/v1\/runs\/([^/]+)$/;
const TASK_RUNS_PATH = /^\/v1\/tasks\/([^/]+)\/runs$/;

/** A job's run document: a summary job's output is its summary. */
function runDocument({ document, tokens, run }: Pick<JobFound, "document" | "tokens" | "run">): RunDocument {
  const output = run.output !== undefined ? run.output : document.summary;
  return {
    run_id: document.job_id,
    task: run.task,
    version: run.version,
    status: document.status,
    ...(output === undefined ? {} : { output }),
    ...(document.error === undefined ? {} : { error: document.error }),
    ...(run.model === undefined ? {} : { model: run.model }),
    attempts: document.attempts ?? 0,
    tokens,
    ...(document.cost_usd === undefined ? {} : { cost_usd: document.cost_usd }),
    ...(document.cached ? { cached: true as const } : {}),
  };
}

/**
 * A queued run's `waiting_for`: `batch` while it is recorded in a provider batch not yet committed (issue 43);
 * `budget` while a worker finds its tenant's budget spent (the mark a blocked tenant's budget carries, renewed
 * every second by the worker that holds its runs back).
 */
async function withWaiting(deps: RunApiDeps, tenant: string, document: RunDocument): Promise<RunDocument> {
  if (document.status !== "queued") return document;
  if (deps.batchOf && await deps.batchOf(document.run_id)) return { ...document, waiting_for: "batch" };
  if (!deps.budgets || !(await deps.budgets.of(tenant))) return document;
  const until = await deps.budgets.waitingUntil(tenant);
  return until > Date.now() ? { ...document, waiting_for: "budget" } : document;
}

/**
 * A run's `priority` and expiry as its stream payload carries them: no field for `normal` (so a normal run's
 * payload is as every release wrote it), and `expires_at`, the acceptance time (now: the run is enqueued in
 * this request) plus `expires_in`. Both request fields are in the body's fingerprint already (the job id hashes
 * the whole validated body), so a replay with another priority or expiry is a 422 like any other difference;
 * a replay keeps the first request's `expires_at`, since it enqueues nothing.
 */
function priorityAndExpiry(
  { priority, expires_in }: Pick<RunRequest, "priority" | "expires_in">,
  nowMs = Date.now(),
): Pick<RunPayload, "priority" | "expires_at"> {
  return {
    ...(priority === undefined || priority === "normal" ? {} : { priority }),
    ...(expires_in === undefined ? {} : { expires_at: nowMs + expires_in * 1000 }),
  };
}

/** A 422 whose problem document names the place in the request body. */
function refused(pointer: string, message: string, title = "The request body failed validation"): HttpError {
  return new HttpError(422, title, {}, { extra: { errors: [{ pointer, message }] } });
}

/** The run routes. */
export function runRoutes(deps: RunApiDeps): Router {
  async function postRun(req: Request, name: string): Promise<Response> {
    const tenant = await deps.authenticate(req);
    if (!TASK_NAME.test(name)) throw new HttpError(404, `No task ${name} for this tenant`);
    // Its input is a whole request, checked (and its model allowed) only by the OpenAI-compatible endpoints.
    if (name === CHAT_TASK) {
      throw new HttpError(404, `No task ${name} here: it runs through /v1/chat/completions and /v1/responses`);
    }
    const key = idempotencyKeyFrom(req);
    return await withBodyAdmitted(deps, req, tenant, async (release) => {
      const raw = await readJsonBody(req, deps.maxBodyBytes, { deadlineMs: deps.bodyDeadlineMs });
      const parsed = parseRunRequest(raw);
      if (!parsed.success) {
        deps.metrics?.api.validationErrors.inc();
        const errors = parsed.error.issues.map((i) => ({ pointer: pointerOf(i.path), message: i.message }));
        throw new HttpError(422, "The request body failed validation", {}, { extra: { errors } });
      }
      const request = parsed.data;
      const size = unstorableJson(request.input);
      if ("pointer" in size) throw refused(`/input${size.pointer}`, size.message);
      // Cached, the version is found without a wait (every await on this path costs throughput).
      const task = deps.tasks.peek(tenant, name, request.version) ??
        await deps.tasks.get(tenant, name, request.version);
      if (!task) {
        throw new HttpError(
          404,
          `No task ${name}${request.version === undefined ? "" : ` version ${request.version}`}`,
        );
      }
      const validating = checkInput(deps, tenant, task, request.input, size.units);
      if (validating) await validating;
      const chars = renderedChars(task.definition, request.input);
      if (chars > RENDER_LIMITS.maxChars) {
        throw refused(
          "/input",
          `the prompt and system message rendered from this input come to ${chars} characters; at most ` +
            `${RENDER_LIMITS.maxChars} are allowed`,
        );
      }
      if (request.notify !== undefined) await checkNotify(deps, tenant, request.notify);
      const scope = { tenant, method: "POST", path: `/v1/tasks/${name}/runs`, key };
      const { definition } = task;
      const refuse = deps.budgets && await budgetRefusal(deps, tenant, {
        model: Array.isArray(definition.model) ? definition.model[0] : definition.model,
        messages: () => [
          renderTemplate(definition.prompt, request.input),
          ...(definition.system === undefined ? [] : [renderTemplate(definition.system, request.input)]),
          // The output schema goes with the call (response_format) and is counted as prompt tokens.
          ...(definition.output_schema === undefined ? [] : [JSON.stringify(definition.output_schema)]),
        ],
        maxOutputTokens: definition.max_output_tokens,
      });
      const payload: RunPayload = {
        task: task.name,
        version: task.version,
        input: request.input,
        notify: request.notify,
        ...(skipsCache(req.headers) ? { no_cache: true as const } : {}),
        ...priorityAndExpiry(request),
      };
      return await answerSubmission(
        deps,
        req,
        tenant,
        () => {
          release();
          return deps.intake.submitRun({
            scope,
            request,
            run: {
              task: task.name,
              version: task.version,
              payload: JSON.stringify(payload),
              // Its lane's stream: a batch run is low until a deployment's Batch API takes it.
              priority: payload.priority === "batch" ? "low" : payload.priority,
              requested: payload.priority,
            },
            traceparent: currentTraceparent(),
            refuse,
          });
        },
        {
          enqueued: (jobId) =>
            deps.log.info("run_enqueued", { job_id: jobId, tenant, task: task.name, version: task.version }),
          // The wait's last look found the run's outcome, with its output and tokens by kind: no second read.
          finished: (_, waited) => Promise.resolve(runDocument(waited.found)),
        },
      );
    });
  }

  async function getRun(req: Request, runId: string): Promise<Response> {
    const tenant = await deps.authenticate(req);
    const found = await jobDocument(deps, tenant, runId);
    if (!found) throw new HttpError(404, `No run ${runId} for this tenant`);
    const headers: Record<string, string> = deps.waiter ? { vary: "prefer" } : {};
    if (!FINISHED.has(found.document.status)) {
      const waited = await waitIfPreferred(deps, req, tenant, runId);
      if (waited?.finished) {
        // The wait's last look found the run's outcome, with its output and tokens by kind: no second read.
        return json(200, runDocument(waited.found), {
          ...headers,
          "preference-applied": waited.applied,
        });
      }
      if (waited) headers["preference-applied"] = waited.applied;
    }
    return json(200, await withWaiting(deps, tenant, runDocument(found)), headers);
  }

  async function cancelRun(req: Request, runId: string): Promise<Response> {
    const tenant = await deps.authenticate(req);
    const cancelled = await cancelJobOf(deps, tenant, runId);
    const found = await jobDocument(deps, tenant, runId);
    if (found) return json(200, runDocument(found));
    return json(200, {
      ...runDocument({
        document: cancelled,
        tokens: { prompt: 0, completion: 0 },
        run: { task: "summarize", version: 1, summaryJob: true },
      }),
    });
  }

  return new Router()
    .on(TASK_RUNS_PATH, { POST: (req, { params }) => postRun(req, params[0]!) }, "/v1/tasks/{name}/runs")
    .on(RUN_PATH, {
      GET: (req, { params }) => getRun(req, params[0]!),
      DELETE: (req, { params }) => cancelRun(req, params[0]!),
    }, "/v1/runs/{run_id}");
}

/**
 * Refuses (422, naming the first failing pointer under `/input`) an input that the version's input schema
 * rejects, that Postgres could not store, or whose validation would take too long.
 */
function checkInput(
  deps: RunApiDeps,
  tenant: string,
  task: { key: string; definition: { input_schema: unknown } },
  input: Record<string, unknown>,
  /** The input's size in the validators' units (from `unstorableJson`). */
  units: number,
): Promise<void> | undefined {
  const key = `${task.key}/input`;
  let now: SchemaViolation[] | undefined;
  try {
    now = deps.validateNow?.(key, task.definition.input_schema, input, units);
  } catch (error) {
    throw validationFailed(deps, task.key, error);
  }
  // A small validation is answered in this thread, without an await (the usual case on this path).
  if (now !== undefined) return refuseViolations(deps, now);
  // In the tenant's turn: a built-in task's key is every tenant's.
  return deps.validate(key, task.definition.input_schema, input, tenant).then(
    (violations) => refuseViolations(deps, violations),
    (error) => {
      throw validationFailed(deps, task.key, error);
    },
  );
}

/**
 * A validation that did not answer: one that took too long, or would, is the input's (a 422); one refused
 * because too many are pending, the tenant's or everyone's, may be tried again soon (a 503 with Retry-After);
 * a version whose stored schema this release cannot compile (a regular expression RE2 cannot run, stored
 * before it) never will be (a 409); any other failure (a validation Worker that did not start, a crash) is
 * the server's, and the client may retry (a 503).
 */
function validationFailed(deps: RunApiDeps, task: string, error: unknown): HttpError {
  if (error instanceof SchemaRefused) {
    return new HttpError(
      409,
      `This task version's input schema cannot be compiled any more (${error.message}); PUT a new version`,
    );
  }
  if (error instanceof ValidationTimeout || error instanceof ValidationTooCostly) {
    return refused("/input", `the input could not be validated: ${error.message}`);
  }
  if (error instanceof ValidationBusy) {
    return new HttpError(503, `${error.message}; try again later`, { "retry-after": String(error.retryAfterS) }, {
      shed: true,
    });
  }
  deps.log.warn("input_validation_failed", { task, error });
  return new HttpError(503, "The input could not be validated now; try again", { "retry-after": "1" });
}

/** Refuses (422) an input with violations, naming the first one's pointer. */
function refuseViolations(deps: RunApiDeps, violations: SchemaViolation[]): undefined {
  const first = violations[0];
  if (first) {
    deps.metrics?.api.validationErrors.inc();
    throw refused(`/input${first.pointer}`, first.message, "The input does not match the task's input schema");
  }
  return undefined;
}

/** A zod issue's path as a JSON pointer into the body. */
function pointerOf(path: PropertyKey[]): string {
  return path.map((p) => `/${String(p).replace(/~/g, "~0").replace(/\//g, "~1")}`).join("");
}
