import type { RedisClient } from "../clients.ts";
import type { Sql } from "postgres";
import { withTimeout } from "../async/timeout.ts";
import { readJsonBody } from "../http/body.ts";
import { errorResponse, HttpError, problem } from "../http/problem.ts";
import { KeyReused } from "../idempotency/errors.ts";
import type { Logger } from "../log/logger.ts";
import { type ApiMetrics, metricsResponse } from "../metrics/metrics.ts";
import type { Registry } from "prom-client";
import type { Authenticate } from "../tenants/authenticator.ts";
import { type Intake, QueueFull } from "./intake.ts";
import type { ServiceKeys } from "./keys.ts";
import { openApiDocument, ROUTES } from "./openapi.ts";
import { IdempotencyKey, SummaryRequest, type SummaryStatus } from "./schemas.ts";

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
  /**
   * Prometheus metrics; `/metrics` serves `registry` (which `dev` shares with
   * the worker and relay), behind `token` as a bearer token when it is set.
   */
  metrics?: { api: ApiMetrics; registry: Registry; token?: string };
}

/** The collection path: POSTs are scoped to it, and job documents live below it. */
export const SUMMARIES = "/v1/summaries";
const JOB_PATH = /^\/v1\/summaries\/([^/]+)$/;
const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/;
const READY_TIMEOUT_MS = 1_000;

function json(status: number, body: unknown, headers: Record<string, string> = {}): Response {
  return new Response(JSON.stringify(body), { status, headers: { ...headers, "content-type": "application/json" } });
}

/** The methods this API serves on some path; every other method is counted as "other" in metrics. */
const SERVED_METHODS: ReadonlySet<string> = new Set(["GET", "HEAD", "POST"]);
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
  return ROUTES.some((r) => r.path === path) ? path : "other";
}

/** A bounded label for a method: a client may send any token as its method, so only served ones are kept. */
function methodLabel(method: string): string {
  return SERVED_METHODS.has(method) ? method : "other";
}

function methodNotAllowed(allow: string): never {
  throw new HttpError(405, `Use ${allow} on this path`, { allow });
}

/**
 * Creates the HTTP API as a plain `(Request) => Promise<Response>`, so tests
 * can call it without a port and `main.ts` hands it to `Deno.serve`.
 */
export function createHandler(deps: ApiDeps): (req: Request) => Promise<Response> {
  const { redis, sql, log, authenticate, intake, keys } = deps;

  async function postSummary(req: Request): Promise<Response> {
    const tenant = await authenticate(req);
    const key = req.headers.get("idempotency-key");
    if (key === null) throw new HttpError(400, "Idempotency-Key header is required");
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
    if (deps.recipients && !(await deps.recipients(tenant, parsed.data.notify))) {
      const domain = parsed.data.notify.slice(parsed.data.notify.lastIndexOf("@") + 1);
      throw new HttpError(422, "The request body failed validation", {}, {
        extra: { errors: [{ path: "notify", message: `this tenant may not email ${domain}` }] },
      });
    }
    const scope = { tenant, method: "POST", path: SUMMARIES, key };
    try {
      const { response, replayed } = await intake.submit({ scope, request: parsed.data });
      const headers: Record<string, string> = { ...response.headers };
      if (replayed) {
        headers["idempotent-replayed"] = "true";
        deps.metrics?.api.replays.inc();
      } else {
        log.info("job_enqueued", { job_id: response.body.job_id, tenant });
      }
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

  async function getSummary(req: Request, jobId: string): Promise<Response> {
    const tenant = await authenticate(req);
    const notFound = new HttpError(404, `No job ${jobId} for this tenant`);
    if (!UUID.test(jobId)) throw notFound;
    const [rows, laneRecord] = await Promise.all([
      sql<{ tenant: string; summary: string }[]>`SELECT tenant, summary FROM summaries WHERE job_id = ${jobId}`,
      redis.hgetall(keys.lane(tenant).job(jobId)),
    ]);
    const done = rows[0];
    // A job queued before lanes has its record beside the old single stream.
    const record = done || laneRecord.tenant ? laneRecord : await redis.hgetall(keys.legacy.job(jobId));
    // Another tenant's job is indistinguishable from an unknown one.
    if (done) {
      if (done.tenant !== tenant) throw notFound;
      return json(200, { job_id: jobId, status: "done", summary: done.summary } satisfies SummaryStatus);
    }
    if (record.tenant !== tenant) throw notFound;
    const body: SummaryStatus = { job_id: jobId, status: record.status === "failed" ? "failed" : "queued" };
    if (body.status === "failed" && record.error) body.error = record.error;
    return json(200, body);
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

  async function route(req: Request, path: string): Promise<Response> {
    if (!STANDARD_METHODS.has(req.method) && routeLabel(path) === "other") {
      throw new HttpError(501, "This server does not implement that method");
    }
    if (path === SUMMARIES) {
      if (req.method !== "POST") methodNotAllowed("POST");
      return await postSummary(req);
    }
    const match = JOB_PATH.exec(path);
    if (match) {
      if (req.method !== "GET" && req.method !== "HEAD") methodNotAllowed("GET");
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
  return async (req) => {
    const started = performance.now();
    const path = new URL(req.url).pathname;
    let response: Response;
    try {
      response = await route(req, path);
    } catch (error) {
      response = errorResponse(error, log, { method: req.method, path });
    }
    if (deps.metrics) {
      const labels = { route: routeLabel(path), method: methodLabel(req.method) };
      deps.metrics.api.requests.inc({ ...labels, status: String(response.status) });
      deps.metrics.api.duration.observe(labels, (performance.now() - started) / 1000);
    }
    return response;
  };
}
