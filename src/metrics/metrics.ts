import { createHash, timingSafeEqual } from "node:crypto";
import { Counter, Gauge, Histogram, Registry } from "prom-client";
import { problem } from "../http/problem.ts";

/** API metrics. */
export interface ApiMetrics {
  requests: Counter<"route" | "method" | "status">;
  duration: Histogram<"route" | "method">;
  replays: Counter;
  keyReuse: Counter;
  validationErrors: Counter;
}

/** Worker metrics. */
export interface WorkerMetrics {
  deliveries: Counter<"source">;
  acked: Counter;
  failures: Counter;
  deadLetters: Counter;
  deadLettersDropped: Counter;
  inFlight: Gauge;
  freeSlots: Gauge;
  modelAttempts: Counter<"outcome">;
  modelRetries: Counter<"reason">;
  deadlineExpiries: Counter;
  modelDuration: Histogram<"outcome">;
  permits: Counter<"kind" | "deployment">;
  permitWait: Histogram;
  rateLimited: Counter<"kind" | "deployment">;
  modelFailures: Counter<"attribution" | "reason" | "deployment">;
  tokens: Counter<"kind" | "deployment">;
  breakerTransitions: Counter<"to" | "deployment">;
}

/** Relay metrics. */
export interface RelayMetrics {
  sends: Counter<"outcome">;
  sendDuration: Histogram;
}

/** A Prometheus registry; `dev` shares one between the three components. */
export function createRegistry(): Registry {
  return new Registry();
}

/** Registers the API metrics. */
export function apiMetrics(registry: Registry): ApiMetrics {
  const registers = [registry];
  return {
    requests: new Counter({
      name: "oncely_http_requests_total",
      help: "HTTP requests by route, method and status.",
      labelNames: ["route", "method", "status"] as const,
      registers,
    }),
    duration: new Histogram({
      name: "oncely_http_request_duration_seconds",
      help: "HTTP request latency.",
      labelNames: ["route", "method"] as const,
      buckets: [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5],
      registers,
    }),
    replays: new Counter({
      name: "oncely_idempotent_replays_total",
      help: "POSTs answered from a stored response (Idempotent-Replayed: true).",
      registers,
    }),
    keyReuse: new Counter({
      name: "oncely_idempotency_key_reuse_total",
      help: "POSTs answered 422 because the key was used with another body.",
      registers,
    }),
    validationErrors: new Counter({
      name: "oncely_validation_errors_total",
      help: "POSTs answered 422 because the body failed validation.",
      registers,
    }),
  };
}

/**
 * Registers the worker metrics. `unlabelledFlows`: the single provider's flow-control series (no `deployment`
 * label) exist from 0; false with LLM_DEPLOYMENTS, whose flows make their own labelled series (`flowEvents`), so
 * no series of a provider that is not there shows.
 */
export function workerMetrics(registry: Registry, { unlabelledFlows = true } = {}): WorkerMetrics {
  const registers = [registry];
  const m: WorkerMetrics = {
    deliveries: new Counter({
      name: "oncely_worker_deliveries_total",
      help: "Messages handed to a handler, by source (new or reclaimed).",
      labelNames: ["source"] as const,
      registers,
    }),
    acked: new Counter({ name: "oncely_worker_acked_total", help: "Messages acknowledged.", registers }),
    failures: new Counter({
      name: "oncely_worker_failures_total",
      help: "Deliveries that failed transiently and stay pending.",
      registers,
    }),
    deadLetters: new Counter({
      name: "oncely_worker_dead_letters_total",
      help: "Messages moved to the dead-letter stream.",
      registers,
    }),
    deadLettersDropped: new Counter({
      name: "oncely_dead_letters_dropped_total",
      help: "Older dead letters dropped by the dead-letter stream's caps (about 10,000 a lane, 7 days).",
      registers,
    }),
    inFlight: new Gauge({ name: "oncely_worker_jobs_in_flight", help: "Handlers running now.", registers }),
    freeSlots: new Gauge({
      name: "oncely_worker_free_slots",
      help: "Handlers this worker could start now (WORKER_CONCURRENCY less those running).",
      registers,
    }),
    modelAttempts: new Counter({
      name: "oncely_model_attempts_total",
      help: "Model call attempts by outcome (ok, retry, give_up, deadline, paused, aborted).",
      labelNames: ["outcome"] as const,
      registers,
    }),
    modelRetries: new Counter({
      name: "oncely_model_retries_total",
      help: "Model call retries by reason (timeout, connection, http_429, ...).",
      labelNames: ["reason"] as const,
      registers,
    }),
    deadlineExpiries: new Counter({
      name: "oncely_model_deadline_exceeded_total",
      help: "Deliveries whose time budget ran out (the job is redelivered).",
      registers,
    }),
    modelDuration: new Histogram({
      name: "oncely_model_call_duration_seconds",
      help: "Duration of one model call attempt.",
      labelNames: ["outcome"] as const,
      buckets: [0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40],
      registers,
    }),
    permits: new Counter({
      name: "oncely_llm_permits_total",
      help: "Model-call permits granted by the shared limiter, by kind (permit, or the breaker's probe).",
      labelNames: ["kind", "deployment"] as const,
      registers,
    }),
    permitWait: new Histogram({
      name: "oncely_llm_permit_wait_seconds",
      help: "Time a model call waited for its permit (pacing, a 429 pause, an open breaker).",
      buckets: [0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60],
      registers,
    }),
    rateLimited: new Counter({
      name: "oncely_llm_429_total",
      help: "429 answers from the model provider, by kind (rate_limited, quota).",
      labelNames: ["kind", "deployment"] as const,
      registers,
    }),
    tokens: new Counter({
      name: "oncely_llm_tokens_total",
      help: "Tokens the model provider reported, by kind (prompt, completion).",
      labelNames: ["kind", "deployment"] as const,
      registers,
    }),
    breakerTransitions: new Counter({
      name: "oncely_llm_breaker_transitions_total",
      help: "Breaker state changes this process caused, by new state.",
      labelNames: ["to", "deployment"] as const,
      registers,
    }),
    modelFailures: new Counter({
      name: "oncely_model_failures_total",
      help: "Failed model calls by whom they were charged to (provider: the breaker or a pause took it; " +
        "job: the job's attempt), and reason.",
      labelNames: ["attribution", "reason", "deployment"] as const,
      registers,
    }),
  };
  // Every series with a known, bounded label set exists from the start (0), not from its first event: a rate()
  // over a series that appears mid-way misses its first increment, and an alert on it cannot tell 0 from absent.
  for (const source of ["new", "reclaimed"]) m.deliveries.inc({ source }, 0);
  for (const outcome of ["ok", "retry", "give_up", "deadline", "paused", "aborted"]) {
    m.modelAttempts.inc({ outcome }, 0);
  }
  if (!unlabelledFlows) return m;
  for (const kind of ["permit", "probe"]) m.permits.inc({ kind }, 0);
  for (const kind of ["rate_limited", "quota"]) m.rateLimited.inc({ kind }, 0);
  for (const kind of ["prompt", "completion"]) m.tokens.inc({ kind }, 0);
  for (const to of ["closed", "open", "half_open"]) m.breakerTransitions.inc({ to }, 0);
  return m;
}

/** Registers the relay metrics. */
export function relayMetrics(registry: Registry): RelayMetrics {
  const registers = [registry];
  const m: RelayMetrics = {
    sends: new Counter({
      name: "oncely_relay_sends_total",
      help: "Outbox sends (emails and webhooks) by outcome (sent, retry, failed).",
      labelNames: ["outcome"] as const,
      registers,
    }),
    sendDuration: new Histogram({
      name: "oncely_relay_send_duration_seconds",
      help: "Duration of successful sends.",
      buckets: [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10],
      registers,
    }),
  };
  for (const outcome of ["sent", "retry", "failed"]) m.sends.inc({ outcome }, 0);
  return m;
}

/** Adds a gauge whose value is read when Prometheus scrapes. */
export function scrapeGauge(
  registry: Registry,
  name: string,
  help: string,
  read: () => Promise<number>,
): Gauge {
  return new Gauge({
    name,
    help,
    registers: [registry],
    async collect() {
      try {
        this.set(await read());
      } catch {
        // A failed read leaves the last value; /metrics must still answer.
      }
    },
  });
}

const digest = (value: string) => createHash("sha256").update(value).digest();

/** Whether `headers` carry `Authorization: Bearer <token>`, compared in constant time. */
export function bearerMatches(headers: Headers, token: string): boolean {
  const presented = /^Bearer\s+(\S+)\s*$/i.exec(headers.get("authorization") ?? "")?.[1] ?? "";
  // Hashing first gives both sides one length, so the comparison time reveals nothing about the token.
  return timingSafeEqual(digest(presented), digest(token));
}

/**
 * The `/metrics` response. With `token` set (METRICS_TOKEN), a request
 * without it as a bearer token gets 401 and no metrics.
 */
export async function metricsResponse(
  registry: Registry,
  { token, headers }: { token?: string; headers?: Headers } = {},
): Promise<Response> {
  if (token !== undefined && !bearerMatches(headers ?? new Headers(), token)) {
    return problem(401, "Authorization: Bearer <METRICS_TOKEN> is required", {
      "www-authenticate": 'Bearer realm="metrics"',
    });
  }
  return new Response(await registry.metrics(), { headers: { "content-type": registry.contentType } });
}

/**
 * Serves `/metrics` on its own port (worker and relay, when METRICS_PORT is set), behind `token` when set, with
 * `/healthz` and, given `ready`, `/readyz` (for a Kubernetes readiness probe).
 */
export function serveMetrics(
  registry: Registry,
  { hostname, port, signal, token, ready }: {
    hostname: string;
    port: number;
    signal: AbortSignal;
    token?: string;
    ready?: () => Promise<Response>;
  },
): Deno.HttpServer {
  return Deno.serve({ hostname, port, signal, onListen: () => {} }, (req) => {
    const path = new URL(req.url).pathname;
    if (path === "/metrics") return metricsResponse(registry, { token, headers: req.headers });
    if (path === "/healthz") return Response.json({ status: "ok" });
    if (path === "/readyz" && ready) return ready();
    return new Response("not found", { status: 404 });
  });
}

/** Result-cache metrics (worker). */
export interface ResultCacheMetrics {
  lookups: Counter<"tenant" | "result">;
}

/** Registers the result-cache metrics. */
export function resultCacheMetrics(registry: Registry): ResultCacheMetrics {
  return {
    lookups: new Counter({
      name: "oncely_result_cache_lookups_total",
      help: "Result-cache lookups by tenant and result: hit (the run reused a done run's output, no model call) " +
        "or miss (it called the model). Runs with the cache off or Cache-Control: no-cache are not counted.",
      labelNames: ["tenant", "result"] as const,
      registers: [registry],
    }),
  };
}
