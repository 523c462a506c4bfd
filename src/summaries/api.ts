import type { RedisClient } from "../clients.ts";
import type { Sql } from "postgres";
import { withTimeout } from "../async/timeout.ts";
import { readJsonBody, releaseUnreadBody } from "../http/body.ts";
import { errorResponse, HttpError, problem } from "../http/problem.ts";
import { KeyReused } from "../idempotency/errors.ts";
import type { Logger } from "../log/logger.ts";
import { type ApiMetrics, metricsResponse } from "../metrics/metrics.ts";
import type { Registry } from "prom-client";
import type { Authenticate } from "../tenants/authenticator.ts";
import { type Intake, QueueFull } from "./intake.ts";
import { cancelJob, type Outcome, readJob } from "../jobs/job_store.ts";
import { publicError } from "./public_error.ts";
import { markCancelled } from "./job_status.ts";
import { type JobWaiter, preferredWaitS } from "./job_waiter.ts";
import { checkWebhookUrl, WebhookRefused } from "../webhooks/addresses.ts";
import { currentTraceparent } from "../tracing.ts";
import type { ServiceKeys } from "./keys.ts";
import { openApiDocument, ROUTES } from "./openapi.ts";
import { IdempotencyKey, idempotencyKeyOf, JOB_ID, SummaryRequest, type SummaryStatus } from "./schemas.ts";

/** What the API handler needs. */
export interface ApiDeps {
  redis: RedisClient;
  sql: Sql;
  log: Logger;
  authenticate: Authenticate;
  intake: Intake;
  keys: ServiceKeys;
  maxBodyBytes: number;
  /** Whether a tenant may email an address (its allowed domains); every address when unset. */
  recipients?: (tenant: string, address: string) => Promise<boolean>;
  /** How long a POST body may take to arrive; default 10 s (`BODY_DEADLINE_MS` in `http/body.ts`). */
  bodyDeadlineMs?: number;
  /** The process's listener for finished jobs; without it, `Prefer: wait` is ignored. */
  waiter?: JobWaiter;
  /** The operator console (`/console`, ADMIN_TOKEN); without it, `/console` answers 404. */
  console?: (req: Request, path: string, client?: { remoteAddr?: Deno.Addr }) => Promise<Response>;
  /** Aborts on shutdown: waiting requests then answer at once with the job's current status. */
  shutdown?: AbortSignal;
  /**
   * Webhook targets: WEBHOOK_ALLOW_HTTP / WEBHOOK_ALLOW_PRIVATE, and whether a
   * tenant has a signing secret. Without it, `notify: {"webhook": ...}` is refused.
   */
  webhooks?: {
    allowHttp: boolean;
    allowPrivate: boolean;
    hasSecret: (tenant: string) => Promise<boolean>;
    /** Whether the tenant may send webhooks to the URL's host (`tenant allow-webhook-host`); any when unset. */
    hosts?: (tenant: string, url: string) => Promise<boolean>;
  };
  /**
   * Prometheus metrics; `/metrics` serves `registry` (which `dev` shares with
   * the worker and relay), behind `token` as a bearer token when it is set.
   */
  metrics?: { api: ApiMetrics; registry: Registry; token?: string };
}

/** What a `Prefer: wait` came to: the job's document, and whether it finished within the wait. */
interface Waited {
  document: SummaryStatus;
  /** The `Preference-Applied` value. */
  applied: string;
  finished: boolean;
}

/** The collection path: POSTs are scoped to it, and job documents live below it. */
export const SUMMARIES = "/v1/summaries";
const JOB_PATH = /^\/v1\/summaries\/([^/]+)$/;
const READY_TIMEOUT_MS = 1_000;

function json(status: number, body: unknown, headers: Record<string, string> = {}): Response {
  return new Response(JSON.stringify(body), { status, headers: { ...headers, "content-type": "application/json" } });
}

/** The methods this API serves on some path; every other method is counted as "other" in metrics. */
const SERVED_METHODS: ReadonlySet<string> = new Set(["GET", "HEAD", "POST", "DELETE"]);
/** Statuses after which a job never changes. */
const FINISHED: ReadonlySet<SummaryStatus["status"]> = new Set(["done", "failed", "cancelled"]);
/** RFC 9110's methods and PATCH. Any other token is unknown: 501, or 405 on a known path. */
const STANDARD_METHODS: ReadonlySet<string> = new Set([
  ...SERVED_METHODS,
  "PUT",
  "DELETE",
  "CONNECT",
  "OPTIONS",
  "TRACE",
  "PATCH",
]);

/** A bounded label for a path: the route template, or "other". */
function routeLabel(path: string): string {
  if (JOB_PATH.test(path)) return "/v1/summaries/{job_id}";
  if (isConsolePath(path)) return "/console";
  return ROUTES.some((r) => r.path === path) ? path : "other";
}

function isConsolePath(path: string): boolean {
  return path === "/console" || path.startsWith("/console/");
}

/** A bounded label for a method: a client may send any token as its method, so only served ones are kept. */
function methodLabel(method: string): string {
  return SERVED_METHODS.has(method) ? method : "other";
}

function methodNotAllowed(allow: string): never {
  throw new HttpError(405, `Use ${allow} on this path`, { allow });
}

function invalid(path: string, message: string): HttpError {
  return new HttpError(422, "The request body failed validation", {}, { extra: { errors: [{ path, message }] } });
}

/**
 * Creates the HTTP API as a plain `(Request) => Promise<Response>`, so tests
 * can call it without a port and `main.ts` hands it to `Deno.serve`.
 */
export function createHandler(
  deps: ApiDeps,
): (req: Request, client?: { remoteAddr?: Deno.Addr }) => Promise<Response> {
  const { redis, sql, log, authenticate, intake, keys } = deps;

  async function postSummary(req: Request): Promise<Response> {
    const tenant = await authenticate(req);
    const header = req.headers.get("idempotency-key");
    if (header === null) throw new HttpError(400, "Idempotency-Key header is required");
    const key = idempotencyKeyOf(header);
    if (!IdempotencyKey.safeParse(key).success) {
      throw new HttpError(400, "Idempotency-Key must be 16 to 128 visible ASCII characters");
    }
    const raw = await readJsonBody(req, deps.maxBodyBytes, { deadlineMs: deps.bodyDeadlineMs });
    const parsed = SummaryRequest.safeParse(raw);
    if (!parsed.success) {
      deps.metrics?.api.validationErrors.inc();
      const errors = parsed.error.issues.map((i) => ({ path: i.path.join("."), message: i.message }));
      throw new HttpError(422, "The request body failed validation", {}, { extra: { errors } });
    }
    const notify = parsed.data.notify;
    if (typeof notify === "string") {
      if (deps.recipients && !(await deps.recipients(tenant, notify))) {
        throw invalid("notify", `this tenant may not email ${notify.slice(notify.lastIndexOf("@") + 1)}`);
      }
    } else {
      if (!deps.webhooks) throw invalid("notify.webhook", "webhooks are not enabled on this server");
      try {
        checkWebhookUrl(notify.webhook, deps.webhooks);
      } catch (error) {
        if (error instanceof WebhookRefused) throw invalid("notify.webhook", error.message);
        throw error;
      }
      if (deps.webhooks.hosts && !(await deps.webhooks.hosts(tenant, notify.webhook))) {
        throw invalid("notify.webhook", `this tenant may not send webhooks to ${new URL(notify.webhook).hostname}`);
      }
      if (!(await deps.webhooks.hasSecret(tenant))) {
        throw invalid(
          "notify.webhook",
          "this tenant has no webhook signing secret yet (deno task tenant rotate-webhook-secret NAME makes one)",
        );
      }
    }
    const scope = { tenant, method: "POST", path: SUMMARIES, key };
    try {
      // With tracing on, the job's trace continues from this request's span (Deno.serve's) in the worker.
      const { response, replayed } = await intake.submit({
        scope,
        request: parsed.data,
        traceparent: currentTraceparent(),
      });
      const headers: Record<string, string> = { ...response.headers };
      if (replayed) {
        headers["idempotent-replayed"] = "true";
        deps.metrics?.api.replays.inc();
      } else {
        log.info("job_enqueued", { job_id: response.body.job_id, tenant });
      }
      if (deps.waiter) headers.vary = "prefer";
      const waited = await waitIfPreferred(req, tenant, response.body.job_id);
      if (waited?.finished) return json(200, waited.document, { ...headers, "preference-applied": waited.applied });
      // A wait that ran out still applied the preference: the client can tell "waited" from "ignored".
      if (waited) headers["preference-applied"] = waited.applied;
      return json(response.status, response.body, headers);
    } catch (error) {
      if (error instanceof QueueFull) {
        throw new HttpError(503, `${error.message}; try again later`, { "retry-after": String(error.retryAfterS) });
      }
      if (error instanceof KeyReused) {
        deps.metrics?.api.keyReuse.inc();
        throw new HttpError(422, error.message);
      }
      throw error;
    }
  }

  /** A job's document as GET shows it, and where its Redis record is; null for an unknown or another tenant's job. */
  async function jobDocument(
    tenant: string,
    jobId: string,
  ): Promise<{ document: SummaryStatus; recordKey?: string } | null> {
    if (!JOB_ID.test(jobId)) return null;
    const laneKey = keys.lane(tenant).job(jobId);
    type Row = {
      tenant: string | null;
      outcome: Outcome | null;
      error: string | null;
      summary: string | null;
      attempts: number;
      tokens: number | null;
    };
    const [rows, laneRecord] = await Promise.all([
      // The outcome, the summary, and the totals of the job's model attempts (those of this tenant only).
      readJob(sql, jobId, tenant),
      redis.hgetall(laneKey),
    ]);
    const decided = rows[0]!;
    const usage = decided.attempts > 0 ? { attempts: decided.attempts, tokens: decided.tokens ?? 0 } : {};
    // Another tenant's job is indistinguishable from an unknown one.
    if (decided.outcome) {
      if (decided.tenant !== tenant) return null;
      if (decided.outcome === "cancelled" || decided.outcome === "failed") {
        const document: SummaryStatus = { job_id: jobId, status: decided.outcome, ...usage };
        if (decided.outcome === "failed") document.error = publicError(decided.error ?? laneRecord.error ?? "");
        return { document, recordKey: laneRecord.tenant ? laneKey : undefined };
      }
      // Done, but its summary is past SUMMARY_RETENTION_S: as if unknown.
      if (decided.summary === null) return null;
      return { document: { job_id: jobId, status: "done", summary: decided.summary, ...usage } };
    }
    const [record, recordKey] = [laneRecord, laneKey];
    if (record.tenant !== tenant) return null;
    const status = record.status === "failed" || record.status === "cancelled" ? record.status : "queued";
    const document: SummaryStatus = { job_id: jobId, status, ...usage };
    if (status === "failed") document.error = publicError(record.error ?? "");
    return { document, recordKey };
  }

  /**
   * `Prefer: wait=N`: waits up to N seconds for the job to finish, woken by
   * its outcome's notification. @returns the document when it finished
   * (`finished`), the latest one when the wait ran out, or null when waiting
   * is not possible here (or was not asked for).
   */
  async function waitIfPreferred(
    req: Request,
    tenant: string,
    jobId: string,
  ): Promise<Waited | null> {
    const waitS = preferredWaitS(req.headers);
    const waiter = deps.waiter;
    if (waitS === undefined || !waiter?.listening || deps.shutdown?.aborted) return null;
    try {
      return await waitFor(req, tenant, jobId, waiter, waitS);
    } catch (error) {
      // The job is accepted (or known) all the same: a failed wait falls back to the usual answer, never a 5xx.
      log.warn("wait_failed", { job_id: jobId, tenant, error });
      return null;
    }
  }

  async function waitFor(
    req: Request,
    tenant: string,
    jobId: string,
    waiter: JobWaiter,
    waitS: number,
  ): Promise<Waited | null> {
    const deadline = performance.now() + waitS * 1000;
    const applied = `wait=${waitS}`;
    // Subscribe before looking, so a finish between the look and the wait still wakes us.
    const subscription = waiter.subscribe(jobId);
    try {
      for (;;) {
        const found = await jobDocument(tenant, jobId);
        if (found && FINISHED.has(found.document.status)) return { document: found.document, applied, finished: true };
        const left = deadline - performance.now();
        if (!found) return null;
        if (left <= 0 || deps.shutdown?.aborted) return { document: found.document, applied, finished: false };
        await subscription.next(left, AbortSignal.any([req.signal, ...(deps.shutdown ? [deps.shutdown] : [])]));
        if (req.signal.aborted) return null;
      }
    } finally {
      subscription.close();
    }
  }

  async function getSummary(req: Request, jobId: string): Promise<Response> {
    const tenant = await authenticate(req);
    const found = await jobDocument(tenant, jobId);
    if (!found) throw new HttpError(404, `No job ${jobId} for this tenant`);
    const headers: Record<string, string> = deps.waiter ? { vary: "prefer" } : {};
    if (!FINISHED.has(found.document.status)) {
      const waited = await waitIfPreferred(req, tenant, jobId);
      if (waited) return json(200, waited.document, { ...headers, "preference-applied": waited.applied });
    }
    return json(200, found.document, headers);
  }

  /**
   * DELETE: cancels a queued job. Postgres decides (the same primary key the
   * commit inserts into), then the Redis record follows, so GET and the
   * worker's pre-check both see it. Cancelling twice gives the same answer.
   */
  async function cancelSummary(req: Request, jobId: string): Promise<Response> {
    const tenant = await authenticate(req);
    const found = await jobDocument(tenant, jobId);
    if (!found) throw new HttpError(404, `No job ${jobId} for this tenant`);
    const { status } = found.document;
    if (status === "done" || status === "failed") {
      throw new HttpError(409, `Job ${jobId} is already ${status} and cannot be cancelled`);
    }
    const cancelled = status === "cancelled" ? "already_cancelled" : await cancelJob(sql, jobId, tenant);
    if (cancelled === "done" || cancelled === "failed") {
      throw new HttpError(409, `Job ${jobId} is already ${cancelled} and cannot be cancelled`);
    }
    if (found.recordKey) await markCancelled(redis, found.recordKey);
    if (status !== "cancelled") log.info("job_cancel_requested", { job_id: jobId, tenant });
    return json(200, { job_id: jobId, status: "cancelled" } satisfies SummaryStatus);
  }

  async function ready(): Promise<Response> {
    const check = async (what: string, probe: () => Promise<unknown>) => {
      try {
        await withTimeout(probe(), READY_TIMEOUT_MS, what);
        return "ok";
      } catch (error) {
        log.warn("readiness_check_failed", { dependency: what, error });
        return "unavailable";
      }
    };
    const [r, p] = await Promise.all([check("redis", () => redis.ping()), check("postgres", () => sql`SELECT 1`)]);
    const ok = r === "ok" && p === "ok";
    return json(ok ? 200 : 503, { status: ok ? "ready" : "not ready", redis: r, postgres: p });
  }

  async function route(req: Request, path: string, client?: { remoteAddr?: Deno.Addr }): Promise<Response> {
    if (isConsolePath(path)) {
      // Off (no ADMIN_TOKEN): indistinguishable from any unknown path.
      if (!deps.console) return problem(404, `No route for ${req.method} ${path}`);
      // The peer's address (Deno.serve's second argument) goes with it, for the log of a failed sign-in.
      return await deps.console(req, path, client);
    }
    if (!STANDARD_METHODS.has(req.method) && routeLabel(path) === "other") {
      throw new HttpError(501, "This server does not implement that method");
    }
    if (path === SUMMARIES) {
      if (req.method !== "POST") methodNotAllowed("POST");
      return await postSummary(req);
    }
    const match = JOB_PATH.exec(path);
    if (match) {
      if (req.method === "DELETE") return await cancelSummary(req, match[1]!);
      if (req.method !== "GET" && req.method !== "HEAD") methodNotAllowed("GET, DELETE");
      return await getSummary(req, match[1]!);
    }
    if (routeLabel(path) !== "other" && req.method !== "GET" && req.method !== "HEAD") methodNotAllowed("GET");
    if (path === "/healthz") return json(200, { status: "ok" });
    if (path === "/readyz") return await ready();
    if (path === "/openapi.json") return json(200, openApi);
    if (path === "/metrics") {
      if (!deps.metrics) return problem(404, "Metrics are not enabled in this process");
      return await metricsResponse(deps.metrics.registry, { token: deps.metrics.token, headers: req.headers });
    }
    return problem(404, `No route for ${req.method} ${path}`);
  }

  const openApi = openApiDocument();
  return async (req, client) => {
    const started = performance.now();
    // A malformed Host header (`Host: a b`) makes the request's URL unparseable: a client error, not a 500.
    const path = URL.parse(req.url)?.pathname;
    let response: Response;
    try {
      if (path === undefined) throw new HttpError(400, "The request's Host header or target is not a valid URL");
      response = await route(req, path, client);
    } catch (error) {
      response = errorResponse(error, log, { method: req.method, path: path ?? "(malformed)" });
    }
    // A request answered before its body was read (401, 405, ...) must not keep its connection while the
    // client drips a body nobody will read.
    releaseUnreadBody(req);
    if (deps.metrics) {
      const labels = { route: path === undefined ? "other" : routeLabel(path), method: methodLabel(req.method) };
      deps.metrics.api.requests.inc({ ...labels, status: String(response.status) });
      deps.metrics.api.duration.observe(labels, (performance.now() - started) / 1000);
    }
    return response;
  };
}
