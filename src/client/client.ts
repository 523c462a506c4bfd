/**
 * A typed client for the Oncely API. It depends on nothing but `fetch` and
 * Web Crypto, and is erasable TypeScript only, so Deno imports it as it is
 * and Node runs it with type stripping.
 *
 * ```ts
 * import { createClient } from "./src/client/client.ts";
 *
 * const oncely = createClient({ baseUrl: "https://oncely.example.com", apiKey: "onc_..." });
 * const { job } = await oncely.summarize({ text, notify: "ops@example.com" });
 * const run = await oncely.waitForRun(job.job_id, { timeoutS: 120 });
 * ```
 *
 * Every request may be sent more than once, and that is safe: GET, PUT
 * (idempotent by content) and DELETE by their method, and each POST carries
 * an `Idempotency-Key` that stays the same on every try.
 *
 * @module
 */
import type {
  Notify,
  Problem,
  Run,
  RunAccepted,
  SummaryAccepted,
  SummaryJob,
  Task,
  TaskDefinition,
  TaskList,
  TaskListItem,
  Usage,
} from "./documents.ts";
import { FINISHED_RUN_STATUSES } from "./documents.ts";
import { OncelyError } from "./errors.ts";
import type { RetryPolicy } from "./_retry.ts";
import { abortableSleep, backoffMs, retryAfterMs, retryDelayMs } from "./_retry.ts";

export type {
  BudgetView,
  JsonSchema,
  Notify,
  Problem,
  ProblemIssue,
  Run,
  RunAccepted,
  RunEvent,
  RunStatus,
  SummaryAccepted,
  SummaryJob,
  SummaryReadyEvent,
  Task,
  TaskDefinition,
  TaskList,
  TaskListItem,
  Usage,
  UsageFigures,
  WebhookEvent,
} from "./documents.ts";
export { FINISHED_RUN_STATUSES } from "./documents.ts";
export { OncelyError, WebhookVerificationError } from "./errors.ts";
export type { VerifyWebhookOptions, WebhookHeaders } from "./webhooks.ts";
export { DEFAULT_WEBHOOK_TOLERANCE_S, verifyWebhook } from "./webhooks.ts";

/** Every default of {@linkcode ClientOptions}, in one place. */
export const CLIENT_DEFAULTS = {
  /** Tries after the first. */
  maxRetries: 4,
  retryBaseMs: 250,
  retryCapMs: 10_000,
  /** A longer `Retry-After` (a budget that resets at month end) is thrown, not waited out. */
  maxRetryAfterS: 60,
  /** `waitForRun`'s limit. */
  waitTimeoutS: 300,
  /** Between polls, when the server does not offer `Prefer: wait`. */
  pollIntervalMs: 1_000,
} as const;

/** The most seconds the API waits in one request (`Prefer: wait=N`, N ≤ 60). */
export const MAX_WAIT_S = 60;

/** How a client reaches the API and retries. */
export interface ClientOptions {
  /** The API's origin, with a path prefix if it is mounted under one. */
  baseUrl: string | URL;
  /** Sent as `Authorization: Bearer`; leave unset where a gateway authenticates. */
  apiKey?: string;
  /** Headers for every request, e.g. a gateway's. */
  headers?: Record<string, string>;
  /** `globalThis.fetch` when unset. */
  fetch?: typeof fetch;
  maxRetries?: number;
  retryBaseMs?: number;
  retryCapMs?: number;
  maxRetryAfterS?: number;
  pollIntervalMs?: number;
  /** In [0, 1); `Math.random` when unset (backoff's jitter). */
  random?: () => number;
  /** How the client waits between tries; a test may record or shorten the waits. */
  sleep?: (ms: number, signal?: AbortSignal) => Promise<void>;
  /** Epoch milliseconds; `Date.now` when unset. */
  now?: () => number;
}

/** Options every call takes. */
export interface CallOptions {
  /** Aborts the call, including a wait between retries; the promise rejects with the signal's reason. */
  signal?: AbortSignal;
}

/** Options of the calls that may wait for the outcome (`Prefer: wait=N`). */
export interface WaitOptions extends CallOptions {
  /** Seconds the server may hold the request until the run finishes, 1..60. */
  waitS?: number;
}

/** Options of a POST that starts work. */
export interface KeyedOptions extends WaitOptions {
  /**
   * `Idempotency-Key`, 16 to 128 visible ASCII characters; a random UUID when
   * unset. Pass your own to make a retry after a crash of your process name
   * the same run.
   */
  idempotencyKey?: string;
}

/** What `startRun` sends. */
export interface StartRunOptions extends KeyedOptions {
  input: { [field: string]: unknown };
  /** The task version; the latest at intake when unset. */
  version?: number;
  notify?: Notify;
  /** `normal` when unset; `high` overtakes the tenant's own normal and low backlog. */
  priority?: "high" | "normal" | "low" | "batch";
  /**
   * A run whose model call has not started within this many seconds (whole, 1 to 604800) ends `expired`, with
   * no model call; its webhook is `run.expired`. No attempt (a retry included) starts after the expiry.
   */
  expiresInS?: number;
  /** Skips the result cache (`Cache-Control: no-cache`). */
  noCache?: boolean;
}

/** What `summarize` sends. */
export interface SummarizeOptions extends KeyedOptions {
  /** 1 to 200,000 characters. */
  text: string;
  notify: Notify;
}

/** What a keyed POST came to, besides its document. */
export interface Intake {
  /** The key sent, so a caller can log it or send it again. */
  idempotencyKey: string;
  /** True when the server answered from the key's stored response (`Idempotent-Replayed`). */
  replayed: boolean;
}

/** A started run: `200` with the finished run when it finished within `waitS`, else `202` queued. */
export type StartedRun<Output = unknown> =
  & Intake
  & ({ status: 200; run: Run<Output> } | { status: 202; run: RunAccepted });

/** A submitted summary: `200` with the finished job when it finished within `waitS`, else `202` queued. */
export type SubmittedSummary = Intake & ({ status: 200; job: SummaryJob } | { status: 202; job: SummaryAccepted });

/** The Oncely API. */
export interface OncelyClient {
  /**
   * Stores a task definition: `201` with a new version when it differs from
   * the latest, `200` with the latest when it is the same.
   * @throws {OncelyError} 422 naming the first failing pointer in `problem.errors`.
   */
  putTask(name: string, definition: TaskDefinition, options?: CallOptions): Promise<{ status: 200 | 201; task: Task }>;
  /**
   * A task's latest version, or `version`.
   * @throws {OncelyError} 404 for a task this tenant does not have.
   */
  getTask(name: string, version?: number, options?: CallOptions): Promise<Task>;
  /**
   * The tenant's tasks with their latest versions (number, time, size; read a definition with `getTask`),
   * `summarize` first, every page of them.
   */
  listTasks(options?: CallOptions): Promise<TaskListItem[]>;
  /**
   * Starts a run of `task` on `options.input`.
   * @throws {OncelyError} 422 for an input the version's schema refuses, 429 over budget.
   */
  startRun<Output = unknown>(task: string, options: StartRunOptions): Promise<StartedRun<Output>>;
  /**
   * A run (a summary job's id works too); with `waitS`, held until it finishes or the wait ends.
   * @throws {OncelyError} 404 for an unknown run.
   */
  getRun<Output = unknown>(runId: string, options?: WaitOptions): Promise<Run<Output>>;
  /**
   * Waits until the run finishes (done, failed, cancelled or expired), in
   * requests of up to 60 s each, and returns it.
   * @throws {DOMException} named `TimeoutError` when it is still queued after `timeoutS`.
   */
  waitForRun<Output = unknown>(runId: string, options?: CallOptions & { timeoutS?: number }): Promise<Run<Output>>;
  /**
   * Cancels a queued run (again is fine).
   * @throws {OncelyError} 409 for a finished run.
   */
  cancelRun<Output = unknown>(runId: string, options?: CallOptions): Promise<Run<Output>>;
  /**
   * Submits a summary job (a run of `summarize`; wait for it with `waitForRun(job.job_id)`).
   * @throws {OncelyError} 422 for a body that fails validation, 503 when the queue stays full.
   */
  summarize(options: SummarizeOptions): Promise<SubmittedSummary>;
  /** The tenant's own calls, tokens, cost, cache hits and budgets over the last `since` (default `24h`). */
  usage(options?: CallOptions & { since?: string }): Promise<Usage>;
}

interface Answer<T> {
  status: number;
  headers: Headers;
  body: T;
}

interface Send {
  body?: unknown;
  headers?: Record<string, string>;
  signal?: AbortSignal;
  /** A POST with an Idempotency-Key: a 409 with Retry-After is its first try still in progress. */
  keyed?: boolean;
}

/** A client's settings, resolved once, and what its calls share: the base URL, fetch, retries and clock. */
interface Transport {
  base: string;
  fetch: typeof fetch;
  maxRetries: number;
  sleep: (ms: number, signal?: AbortSignal) => Promise<void>;
  now: () => number;
  pollIntervalMs: number;
  policy: RetryPolicy;
  /** Sent with every request. */
  headers: Record<string, string>;
}

/**
 * A client for the API at `options.baseUrl`.
 * @throws {TypeError} for a `baseUrl` that is not an absolute URL.
 */
export function createClient(options: ClientOptions): OncelyClient {
  const transport = transportOf(options);
  const send = <T>(method: string, path: string, init: Send = {}) => sendRequest<T>(transport, method, path, init);

  async function getRun<Output>(runId: string, options: WaitOptions = {}): Promise<Run<Output>> {
    const path = `/v1/runs/${encodeURIComponent(runId)}`;
    return (await send<Run<Output>>("GET", path, { headers: preferWait(options.waitS), signal: options.signal }))
      .body;
  }

  return {
    async putTask(name, definition, options = {}) {
      const answer = await send<Task>("PUT", `/v1/tasks/${encodeURIComponent(name)}`, {
        body: definition,
        signal: options.signal,
      });
      return { status: answer.status === 201 ? 201 : 200, task: answer.body };
    },

    async getTask(name, version, options = {}) {
      const path = `/v1/tasks/${encodeURIComponent(name)}` + (version === undefined ? "" : `/versions/${version}`);
      return (await send<Task>("GET", path, { signal: options.signal })).body;
    },

    async usage(options = {}) {
      const query = options.since === undefined ? "" : `?since=${encodeURIComponent(options.since)}`;
      return (await send<Usage>("GET", `/v1/usage${query}`, { signal: options.signal })).body;
    },

    async listTasks(options = {}) {
      const tasks: TaskListItem[] = [];
      for (let path: string | null = "/v1/tasks"; path !== null;) {
        const page: TaskList = (await send<TaskList>("GET", path, { signal: options.signal })).body;
        tasks.push(...page.tasks);
        // Only a path of this API is followed: the client's headers never go to another origin.
        path = page.next?.startsWith("/v1/tasks?") ? page.next : null;
      }
      return tasks;
    },

    async startRun<Output>(task: string, options: StartRunOptions): Promise<StartedRun<Output>> {
      const body = {
        input: options.input,
        ...(options.version === undefined ? {} : { version: options.version }),
        ...(options.notify === undefined ? {} : { notify: options.notify }),
        ...(options.priority === undefined ? {} : { priority: options.priority }),
        ...(options.expiresInS === undefined ? {} : { expires_in: options.expiresInS }),
      };
      const { answer, intake } = await keyedPost<Run<Output> & RunAccepted>(
        transport,
        `/v1/tasks/${encodeURIComponent(task)}/runs`,
        body,
        options,
        options.noCache ? { "cache-control": "no-cache" } : {},
      );
      return answer.status === 200
        ? { ...intake, status: 200, run: answer.body }
        : { ...intake, status: 202, run: { run_id: answer.body.run_id, status: "queued" } };
    },

    getRun,

    waitForRun: (runId, options) => waitForRun(transport, runId, options),

    async cancelRun<Output>(runId: string, options: CallOptions = {}) {
      return (await send<Run<Output>>("DELETE", `/v1/runs/${encodeURIComponent(runId)}`, { signal: options.signal }))
        .body;
    },

    async summarize(options) {
      const { answer, intake } = await keyedPost<SummaryJob>(
        transport,
        "/v1/summaries",
        {
          text: options.text,
          notify: options.notify,
        },
        options,
        {},
      );
      return answer.status === 200
        ? { ...intake, status: 200, job: answer.body }
        : { ...intake, status: 202, job: { job_id: answer.body.job_id, status: "queued" } };
    },
  };
}

/** `options` resolved, each unset one to its {@linkcode CLIENT_DEFAULTS} entry. */
function transportOf(options: ClientOptions): Transport {
  const now = options.now ?? Date.now;
  return {
    base: new URL(options.baseUrl).href.replace(/\/+$/, ""),
    fetch: options.fetch ?? ((input, init) => fetch(input, init)),
    maxRetries: options.maxRetries ?? CLIENT_DEFAULTS.maxRetries,
    sleep: options.sleep ?? abortableSleep,
    now,
    pollIntervalMs: options.pollIntervalMs ?? CLIENT_DEFAULTS.pollIntervalMs,
    policy: {
      baseMs: options.retryBaseMs ?? CLIENT_DEFAULTS.retryBaseMs,
      capMs: options.retryCapMs ?? CLIENT_DEFAULTS.retryCapMs,
      maxRetryAfterMs: (options.maxRetryAfterS ?? CLIENT_DEFAULTS.maxRetryAfterS) * 1000,
      random: options.random ?? Math.random,
      now,
    },
    headers: {
      accept: "application/json",
      ...options.headers,
      ...(options.apiKey === undefined ? {} : { authorization: `Bearer ${options.apiKey}` }),
    },
  };
}

/**
 * Sends one request, and again while its answer (or its lack of one) is worth retrying.
 * @throws {OncelyError} for an answer that is not 2xx once retries are spent or pointless.
 */
async function sendRequest<T>(t: Transport, method: string, path: string, init: Send): Promise<Answer<T>> {
  // Called unbound, as given: a `fetch` called as a method of another object throws in a browser.
  const { fetch: doFetch, sleep, policy, maxRetries } = t;
  const { signal } = init;
  const headers = { ...t.headers, ...init.headers };
  if (init.body !== undefined) headers["content-type"] = "application/json";
  const body = init.body === undefined ? undefined : JSON.stringify(init.body);
  for (let attempt = 0;; attempt++) {
    signal?.throwIfAborted();
    let response: Response;
    let text: string;
    try {
      // Never followed: a redirect would carry the API key, the Idempotency-Key and the body to another address.
      response = await doFetch(`${t.base}${path}`, { method, headers, body, signal, redirect: "manual" });
      // A connection that drops mid-body fails here, not in fetch: the same case as no answer at all.
      text = await response.text();
    } catch (error) {
      if (signal?.aborted) throw signal.reason;
      if (attempt >= maxRetries) throw error;
      // No answer: the server may or may not have acted, and only a request that is safe to repeat
      // (all of ours, see the module doc) may be sent again.
      await sleep(backoffMs(policy, attempt), signal);
      continue;
    }
    if (response.ok) return { status: response.status, headers: response.headers, body: parseJson(text, path) };
    const delay = retryDelayMs(policy, response, attempt, init.keyed === true);
    if (delay === undefined || attempt >= maxRetries) throw errorOf(t, response, text);
    await sleep(delay, signal);
  }
}

/** The error of an answer that is not 2xx, with its problem document and `Retry-After`. */
function errorOf({ now }: Transport, response: Response, text: string): OncelyError {
  const asked = retryAfterMs(response.headers.get("retry-after"), now());
  return new OncelyError(problemOf(response, text), {
    retryAfterS: asked === undefined ? undefined : Math.ceil(asked / 1000),
  });
}

/** A POST with an `Idempotency-Key` (the caller's, or a new one that every retry sends again). */
async function keyedPost<T>(
  t: Transport,
  path: string,
  body: unknown,
  options: KeyedOptions,
  headers: Record<string, string>,
) {
  const idempotencyKey = options.idempotencyKey ?? crypto.randomUUID();
  const answer = await sendRequest<T>(t, "POST", path, {
    body,
    headers: { ...headers, "idempotency-key": idempotencyKey, ...preferWait(options.waitS) },
    signal: options.signal,
    keyed: true,
  });
  return { answer, intake: { idempotencyKey, replayed: answer.headers.get("idempotent-replayed") === "true" } };
}

/** {@linkcode OncelyClient.waitForRun}: waits in requests of up to {@linkcode MAX_WAIT_S}, or polls. */
async function waitForRun<Output>(
  t: Transport,
  runId: string,
  options: CallOptions & { timeoutS?: number } = {},
): Promise<Run<Output>> {
  const { now, sleep } = t;
  const timeoutS = options.timeoutS ?? CLIENT_DEFAULTS.waitTimeoutS;
  const deadline = now() + timeoutS * 1000;
  for (;;) {
    const left = deadline - now();
    const waitS = Math.min(MAX_WAIT_S, Math.max(1, Math.ceil(left / 1000)));
    const path = `/v1/runs/${encodeURIComponent(runId)}`;
    const { body: run, headers } = await sendRequest<Run<Output>>(t, "GET", path, {
      headers: preferWait(waitS),
      signal: options.signal,
    });
    if (FINISHED_RUN_STATUSES.has(run.status)) return run;
    if (now() >= deadline) {
      throw new DOMException(`Run ${runId} is still ${run.status} after ${timeoutS} s`, "TimeoutError");
    }
    // A server that ignored the preference answered at once: poll, rather than spin.
    if (!headers.has("preference-applied")) {
      await sleep(Math.min(t.pollIntervalMs, Math.max(0, deadline - now())), options.signal);
    }
  }
}

/**
 * `Prefer: wait=N`, or nothing.
 * @throws {RangeError} for a wait that is not a whole number of seconds from 1 to 60.
 */
function preferWait(waitS: number | undefined): Record<string, string> {
  if (waitS === undefined) return {};
  if (!Number.isInteger(waitS) || waitS < 1 || waitS > MAX_WAIT_S) {
    throw new RangeError(`waitS must be a whole number of seconds from 1 to ${MAX_WAIT_S} (got ${waitS})`);
  }
  return { prefer: `wait=${waitS}` };
}

function parseJson<T>(text: string, path: string): T {
  try {
    return JSON.parse(text) as T;
  } catch (error) {
    throw new TypeError(`Oncely answered ${path} with a body that is not JSON: ${text.slice(0, 200)}`, {
      cause: error,
    });
  }
}

/** The response's problem document, or one made from its status and text when it sent none. */
function problemOf(response: Response, text: string): Problem {
  if (response.status >= 300 && response.status < 400) {
    const location = response.headers.get("location");
    return {
      type: "about:blank",
      title: "Redirect not followed",
      status: response.status,
      detail:
        `The server answered ${response.status}${location ? ` to ${location}` : ""}: the client does not follow ` +
        "redirects, which would carry the API key and the request to another address; set baseUrl to the address " +
        "that answers",
    };
  }
  try {
    const parsed = JSON.parse(text);
    if (parsed && typeof parsed === "object" && typeof parsed.title === "string") {
      return { type: "about:blank", ...parsed, status: response.status };
    }
  } catch {
    // Not JSON: a proxy's page, or a connection cut short.
  }
  return {
    type: "about:blank",
    title: response.statusText || "Error",
    status: response.status,
    detail: text.slice(0, 500),
  };
}
