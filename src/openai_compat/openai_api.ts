/**
 * The OpenAI-compatible front door (`../shared/CONTRACT.md`, "OpenAI-compatible endpoints"):
 * `POST /v1/chat/completions`, `POST /v1/responses`, `GET /v1/responses/{id}` and
 * `POST /v1/responses/{id}/cancel`. Each request is a run of the built-in `chat` task through the same intake
 * as `POST /v1/tasks/{name}/runs` (so the same lanes, worker, deployments, budgets, cache and commit); this
 * module only reads OpenAI's request shapes and answers in OpenAI's, from the committed result.
 */
import { readJsonBody } from "../http/body.ts";
import { HttpError } from "../http/problem.ts";
import { QueueFull } from "../runs/intake.ts";
import { json, Router } from "../http/router.ts";
import { currentTraceparent } from "../tracing.ts";
import {
  budgetRefusal,
  cancelJobOf,
  FINISHED,
  type RunHttpDeps,
  submissionRefusal,
  waitIfPreferred,
  withBodyAdmitted,
} from "../runs/http.ts";
import { jobDocument, type JobFound } from "../runs/job_document.ts";
import { preferredWaitS } from "../runs/job_waiter.ts";
import type { RunPayload } from "../runs/run_payload.ts";
import { IDEMPOTENCY_KEY, idempotencyKeyOf } from "../runs/shapes.ts";
import { skipsCache } from "../cache/result_cache.ts";
import { CHAT_TASK, conversationText } from "../tasks/chat_task.ts";
import { openAiErrorResponse, OpenAiRefusal } from "./errors.ts";
import { readChatRequest, readResponsesRequest } from "./requests.ts";
import { type EchoingInput, echoOf, NO_ECHO, type ResponseEcho, storedEcho, withEcho } from "./response_echo.ts";

/** The longest a request may ask to wait (`Prefer: wait=N`), and the default (OPENAI_COMPAT_WAIT_S). */
export const OPENAI_WAIT = { maxS: 600, defaultS: 60 } as const;

/** How long a done run's answer waits for its usage to be recorded (the attempt log's batches: 200 ms). */
const USAGE_WAIT_MS = 1_000;

/**
 * SSE comments go out at least this often while a streamed run waits, so no proxy times the stream out: the
 * default of {@linkcode OpenAiApiDeps.keepAliveMs}.
 */
export const KEEPALIVE_MS = 15_000;

/** What the OpenAI-compatible routes need beyond the run APIs'. */
export interface OpenAiApiDeps extends RunHttpDeps {
  /** The models a deployment serves (`servedModels`); any model when unset. */
  models?: ReadonlySet<string>;
  /** OPENAI_COMPAT_WAIT_S: how long a request waits for its run when it sends no `Prefer: wait`. */
  waitS?: number;
  /** How often a streamed run's SSE comments go out while it waits; {@linkcode KEEPALIVE_MS} when unset. */
  keepAliveMs?: number;
}

const CHAT_PATH = "/v1/chat/completions";
const RESPONSES_PATH = "/v1/responses";
const RESPONSE_PATH = /^\/v1\/responses\/([^/]+)$/;
const CANCEL_PATH = /^\/v1\/responses\/([^/]+)\/cancel$/;

/** `chatcmpl-` or `resp_` and the run id without dashes. */
export function openAiId(prefix: "chatcmpl-" | "resp_", runId: string): string {
  return `${prefix}${runId.replaceAll("-", "")}`;
}

/** The run id a `resp_` id names; undefined for anything else. */
export function runIdOf(responseId: string): string | undefined {
  const m = /^resp_([0-9a-f]{8})([0-9a-f]{4})([0-9a-f]{4})([0-9a-f]{4})([0-9a-f]{12})$/.exec(responseId);
  return m ? m.slice(1).join("-") : undefined;
}

/** A run's committed output as message text: a string as it is, anything else as JSON. */
function textOf(output: unknown): string {
  return typeof output === "string" ? output : JSON.stringify(output) ?? "";
}

function usageOf(found: JobFound) {
  const { prompt, completion } = found.tokens;
  return { prompt_tokens: prompt, completion_tokens: completion, total_tokens: prompt + completion };
}

/** A done run as a `chat.completion`. */
function chatCompletion(found: JobFound, model: string) {
  return {
    id: openAiId("chatcmpl-", found.document.job_id),
    object: "chat.completion",
    created: Math.floor(Date.now() / 1000),
    model: found.run.model ?? model,
    choices: [{
      index: 0,
      message: { role: "assistant", content: textOf(found.run.output), refusal: null },
      finish_reason: "stop",
      logprobs: null,
    }],
    usage: usageOf(found),
  };
}

/** A run as a Responses `response` object, in whatever state it is. */
function responseObject(found: JobFound | { runId: string; status: "queued" }, model: string, echo: ResponseEcho) {
  const runId = "runId" in found ? found.runId : found.document.job_id;
  const base = {
    id: openAiId("resp_", runId),
    object: "response",
    created_at: Math.floor(Date.now() / 1000),
    model,
    background: echo.background,
    instructions: echo.instructions,
    metadata: echo.metadata,
    error: null as unknown,
    incomplete_details: null as unknown,
    output: [] as unknown[],
    usage: null as unknown,
    parallel_tool_calls: false,
    tool_choice: "none",
    tools: [],
  };
  if ("runId" in found) return { ...base, status: "queued" };
  const { status } = found.document;
  const named = { ...base, model: found.run.model ?? model };
  if (status === "done") {
    const { prompt_tokens, completion_tokens, total_tokens } = usageOf(found);
    return {
      ...named,
      status: "completed",
      output: [{
        type: "message",
        id: openAiId("resp_", runId).replace("resp_", "msg_"),
        status: "completed",
        role: "assistant",
        content: [{ type: "output_text", text: textOf(found.run.output), annotations: [] }],
      }],
      usage: { input_tokens: prompt_tokens, output_tokens: completion_tokens, total_tokens },
    };
  }
  if (status === "failed") {
    return { ...named, status: "failed", error: { code: "server_error", message: found.document.error ?? "failed" } };
  }
  if (status === "cancelled") return { ...named, status: "cancelled" };
  if (status === "expired") return { ...named, status: "incomplete", incomplete_details: { reason: "expired" } };
  return { ...named, status: (found.document.attempts ?? 0) > 0 ? "in_progress" : "queued" };
}

/**
 * A finished run that did not end done, as the provider would have answered (the reason withheld as elsewhere:
 * the document's `error` is already `publicError`'s class). `headers` name the run (`Oncely-Run-Id`).
 */
function notDone(found: JobFound, headers: Record<string, string> = {}): OpenAiRefusal {
  const { status, error } = found.document;
  const final = { ...headers, "x-should-retry": "false" };
  if (status === "failed") {
    return new OpenAiRefusal(400, error ?? "The model call failed", { code: "run_failed" }, final);
  }
  return new OpenAiRefusal(409, `The run is ${status}`, { code: `run_${status}` }, final);
}

/** The 408 of a run that did not finish within the wait: the SDK retries it only when the key makes that safe. */
function pending(runId: string, keyed: boolean, headers: Record<string, string> = {}): OpenAiRefusal {
  return new OpenAiRefusal(
    408,
    `Run ${runId} has not finished yet; it goes on. ${
      keyed
        ? "Retry with the same Idempotency-Key to wait for it again"
        : "Without an Idempotency-Key a retry would be a new run: read it at /v1/runs/" + runId
    }`,
    { code: "run_pending", type: "timeout_error" },
    { ...headers, "retry-after": "1", "x-should-retry": keyed ? "true" : "false" },
  );
}

/** Accepts the run (or finds it, on a replay): `input` is its input, `fingerprint` what its key's record covers. */
async function submit(
  deps: OpenAiApiDeps,
  req: Request,
  tenant: string,
  path: string,
  input: EchoingInput,
  fingerprint: unknown,
) {
  const header = req.headers.get("idempotency-key");
  let key: string;
  if (header === null) key = `openai-door-${crypto.randomUUID()}`;
  else {
    key = idempotencyKeyOf(header);
    if (!IDEMPOTENCY_KEY.test(key)) {
      throw new OpenAiRefusal(400, "Idempotency-Key must be 16 to 128 visible ASCII characters", {
        param: "Idempotency-Key",
      });
    }
  }
  if (deps.models && !deps.models.has(input.model)) {
    throw new OpenAiRefusal(404, `The model ${input.model} does not exist or is not served here`, {
      param: "model",
      code: "model_not_found",
    });
  }
  const refuse = deps.budgets && await budgetRefusal(deps, tenant, {
    model: input.model,
    messages: () => [
      conversationText(input.messages),
      ...(input.format?.type === "json_schema" ? [JSON.stringify(input.format.schema)] : []),
    ],
    maxOutputTokens: input.max_output_tokens ?? 1024,
  });
  const payload: RunPayload = {
    task: CHAT_TASK,
    version: 1,
    input: input as unknown as Record<string, unknown>,
    ...(skipsCache(req.headers) ? { no_cache: true as const } : {}),
  };
  try {
    const result = await deps.intake.submitRun({
      scope: { tenant, method: "POST", path, key },
      request: fingerprint,
      run: { task: CHAT_TASK, version: 1, payload: JSON.stringify(payload) },
      traceparent: currentTraceparent(),
      refuse,
    });
    if (result.replayed) deps.metrics?.api.replays.inc();
    else deps.log.info("run_enqueued", { job_id: result.jobId, tenant, task: CHAT_TASK, version: 1 });
    return { runId: result.jobId, replayed: result.replayed, keyed: header !== null };
  } catch (error) {
    const refusal = submissionRefusal(deps, error);
    // Without a key, an error after which the run may be recorded all the same (too few replicas acknowledged
    // it, or one the intake did not expect) must not invite the SDK's retry: it would start a second run. A full
    // queue wrote nothing, and a 4xx is not retried.
    if (header !== null || error instanceof QueueFull) throw refusal;
    if (!(refusal instanceof HttpError)) {
      throw new HttpError(500, "The server could not complete the request", { "x-should-retry": "false" }, {
        cause: error,
      });
    }
    if (refusal.status >= 500) refusal.headers["x-should-retry"] = "false";
    throw refusal;
  }
}

/** How the routes look at a run: shared with the stream. */
interface Looks {
  waitOf(req: Request): number;
  finished(req: Request, tenant: string, runId: string, waitS: number): Promise<JobFound | undefined>;
  withUsage(tenant: string, runId: string, found: JobFound | undefined): Promise<JobFound | undefined>;
}

/** `stream: true`: comments while the run waits, then the committed result as chunks, then `[DONE]`. */
function streamed(
  deps: OpenAiApiDeps,
  run: Looks,
  req: Request,
  tenant: string,
  runId: string,
  model: string,
  includeUsage: boolean,
  headers: Record<string, string>,
): Response {
  const encoder = new TextEncoder();
  const until = performance.now() + run.waitOf(req) * 1000;
  const keepAliveMs = deps.keepAliveMs ?? KEEPALIVE_MS;
  const body = new ReadableStream<Uint8Array>({
    async start(controller) {
      const send = (text: string) => controller.enqueue(encoder.encode(text));
      const event = (data: unknown) => send(`data: ${JSON.stringify(data)}\n\n`);
      try {
        send(": accepted\n\n");
        let found: JobFound | undefined;
        for (;;) {
          const left = until - performance.now();
          if (left <= 0 || req.signal.aborted || deps.shutdown?.aborted) break;
          found = await run.finished(req, tenant, runId, Math.min(left, keepAliveMs) / 1000);
          if (found) break;
          const now = await jobDocument(deps, tenant, runId);
          if (now && FINISHED.has(now.document.status)) {
            found = await run.withUsage(tenant, runId, now);
            break;
          }
          send(": waiting\n\n");
        }
        if (req.signal.aborted) return;
        if (!found || found.document.status !== "done") {
          const refusal = found ? notDone(found) : pending(runId, false);
          event({
            error: {
              message: refusal.detail,
              type: refusal.openai.type ?? "invalid_request_error",
              param: null,
              code: refusal.openai.code,
            },
          });
          return;
        }
        const completion = chatCompletion(found, model);
        const chunk = (choices: unknown[], extra: Record<string, unknown> = {}) => ({
          id: completion.id,
          object: "chat.completion.chunk",
          created: completion.created,
          model: completion.model,
          choices,
          ...extra,
        });
        const content = completion.choices[0]!.message.content;
        event(chunk([{ index: 0, delta: { role: "assistant", content: "" }, finish_reason: null, logprobs: null }]));
        event(chunk([{ index: 0, delta: { content }, finish_reason: null, logprobs: null }]));
        event(chunk([{ index: 0, delta: {}, finish_reason: "stop", logprobs: null }]));
        if (includeUsage) event(chunk([], { usage: completion.usage }));
        send("data: [DONE]\n\n");
      } catch (error) {
        deps.log.warn("stream_failed", { job_id: runId, tenant, error });
      } finally {
        try {
          controller.close();
        } catch {
          // The client went away: the stream is already cancelled.
        }
      }
    },
  });
  return new Response(body, {
    status: 200,
    headers: { ...headers, "content-type": "text/event-stream", "cache-control": "no-cache" },
  });
}

/** The OpenAI-compatible routes. */
export function openAiRoutes(deps: OpenAiApiDeps): Router {
  const maxWait = deps.waitS ?? OPENAI_WAIT.defaultS;
  const waitOf = (req: Request) => preferredWaitS(req.headers, OPENAI_WAIT.maxS) ?? maxWait;

  /** Waits for the run up to `waitS`: its document when it finished, else undefined. */
  async function finished(req: Request, tenant: string, runId: string, waitS: number) {
    const waited = await waitIfPreferred(deps, req, tenant, runId, waitS);
    if (!waited?.finished) return undefined;
    // The wait's last look found the run's outcome: no second read.
    return await withUsage(tenant, runId, waited.found);
  }

  /**
   * A done run's document once its usage is known: its commit keeps its tokens with its result
   * (`run_results.prompt_tokens`, ...), so this is at once; a run committed by a release before that is looked
   * at again until its `model_attempts` rows (written in batches after the commit) are there, for at most
   * {@linkcode USAGE_WAIT_MS}. A cached run made no call and has none.
   */
  async function withUsage(tenant: string, runId: string, found: JobFound | undefined) {
    const end = performance.now() + USAGE_WAIT_MS;
    while (
      found?.document.status === "done" && !found.document.cached && !found.tokensKnown && performance.now() < end
    ) {
      await new Promise((resolve) => setTimeout(resolve, 50));
      found = await jobDocument(deps, tenant, runId) ?? found;
    }
    return found;
  }

  /**
   * Any error once a run is accepted names it (`Oncely-Run-Id`), an unexpected one (a 500) included. Without a key,
   * no error invites the SDK to retry (`x-should-retry: false`): a retry would start a second run.
   */
  async function namingRun(
    headers: Record<string, string>,
    keyed: boolean,
    answer: () => Promise<Response>,
  ): Promise<Response> {
    try {
      return await answer();
    } catch (error) {
      return openAiErrorResponse(error, deps.log, keyed ? headers : { ...headers, "x-should-retry": "false" });
    }
  }

  async function chat(req: Request): Promise<Response> {
    const tenant = await deps.authenticate(req);
    const accepted = await withBodyAdmitted(deps, req, tenant, async (release) => {
      const raw = await readJsonBody(req, deps.maxBodyBytes, { deadlineMs: deps.bodyDeadlineMs });
      const request = readChatRequest(raw);
      release();
      return { request, ...await submit(deps, req, tenant, CHAT_PATH, request.input, request.fingerprint) };
    });
    const { request, runId, replayed, keyed } = accepted;
    const headers: Record<string, string> = {
      "oncely-run-id": runId,
      ...(replayed ? { "idempotent-replayed": "true" } : {}),
    };
    if (request.stream) {
      return streamed(
        deps,
        { waitOf, finished, withUsage },
        req,
        tenant,
        runId,
        request.input.model,
        request.includeUsage,
        headers,
      );
    }
    return await namingRun(headers, keyed, async () => {
      const found = await finished(req, tenant, runId, waitOf(req));
      if (!found) throw pending(runId, keyed, headers);
      if (found.document.status !== "done") throw notDone(found, headers);
      return json(200, chatCompletion(found, request.input.model), headers);
    });
  }

  async function createResponse(req: Request): Promise<Response> {
    const tenant = await deps.authenticate(req);
    const { request, echo, runId, replayed, keyed } = await withBodyAdmitted(deps, req, tenant, async (release) => {
      const raw = await readJsonBody(req, deps.maxBodyBytes, { deadlineMs: deps.bodyDeadlineMs });
      const request = readResponsesRequest(raw);
      release();
      const echo = echoOf(request);
      // Kept in the run's input so that GET answers it too; the fingerprint is still the body as sent.
      const input = withEcho(request.input, echo);
      return { request, echo, ...await submit(deps, req, tenant, RESPONSES_PATH, input, request.fingerprint) };
    });
    const headers: Record<string, string> = {
      "oncely-run-id": runId,
      ...(replayed ? { "idempotent-replayed": "true" } : {}),
    };
    return await namingRun(headers, keyed, async () => {
      if (request.background) {
        const now = await jobDocument(deps, tenant, runId);
        return json(200, responseObject(now ?? { runId, status: "queued" }, request.input.model, echo), headers);
      }
      const found = await finished(req, tenant, runId, waitOf(req));
      if (!found) throw pending(runId, keyed, headers);
      if (found.document.status === "failed") throw notDone(found, headers);
      return json(200, responseObject(found, request.input.model, echo), headers);
    });
  }

  async function responseOf(req: Request, id: string, cancel: boolean): Promise<Response> {
    const tenant = await deps.authenticate(req);
    const runId = runIdOf(id);
    const notFound = () => new OpenAiRefusal(404, `No response ${id}`, { param: "response_id" });
    const look = async () => {
      const found = runId === undefined ? null : await jobDocument(deps, tenant, runId);
      if (!found || found.run.task !== CHAT_TASK) throw notFound();
      return found;
    };
    let found = await look();
    if (!cancel) found = (await withUsage(tenant, runId!, found))!;
    if (cancel && !FINISHED.has(found.document.status)) {
      try {
        await cancelJobOf(deps, tenant, runId!);
      } catch (error) {
        // Finished meanwhile: answered as it is.
        if (!(error instanceof HttpError && error.status === 409)) throw error;
      }
      found = await look();
    }
    const echo = found.document.status === "done" ? await storedEcho(deps.sql, runId!) : NO_ECHO;
    return json(200, responseObject(found, found.run.model ?? "", echo), { "oncely-run-id": runId! });
  }

  /** Every answer of these paths, errors included, in OpenAI's shape. */
  const openAi = (handle: (req: Request, id: string) => Promise<Response>) => async (req: Request, id: string) => {
    try {
      return await handle(req, id);
    } catch (error) {
      return openAiErrorResponse(error, deps.log);
    }
  };
  const chatRoute = openAi((req) => chat(req));
  const createRoute = openAi((req) => createResponse(req));
  const getRoute = openAi((req, id) => responseOf(req, id, false));
  const cancelRoute = openAi((req, id) => responseOf(req, id, true));
  return new Router()
    .on(CHAT_PATH, { POST: (req) => chatRoute(req, "") })
    .on(RESPONSES_PATH, { POST: (req) => createRoute(req, "") })
    .on(CANCEL_PATH, { POST: (req, { params }) => cancelRoute(req, params[0]!) }, "/v1/responses/{response_id}/cancel")
    .on(RESPONSE_PATH, { GET: (req, { params }) => getRoute(req, params[0]!) }, "/v1/responses/{response_id}");
}
