import type { RunContext } from "./run_context.ts";
import { createBodyAdmission } from "../http/body_admission.ts";
import type { ComponentDeps } from "./_deps.ts";
import { type ApiMetrics, apiMetrics, createRegistry, metricsResponse } from "../metrics/metrics.ts";
import type { Registry } from "prom-client";
import { healthRoutes } from "../http/health.ts";
import { type Client, json, Router } from "../http/router.ts";
import { openApiDocument } from "./openapi.ts";
import { SUMMARIES, type SummaryApiDeps, summaryRoutes } from "../summaries/api.ts";
import { createIntake } from "../runs/intake.ts";
import { type TaskPutLimits, taskRoutes } from "../tasks/api.ts";
import { createDefinitionChecker, type DefinitionChecker } from "../tasks/definition_checker.ts";
import { type RunApiDeps, runRoutes } from "../runs/runs_api.ts";
import { openAiRoutes } from "../openai_compat/openai_api.ts";
import { createBudgets } from "../budgets/budgets.ts";
import { budgetEvents } from "../budgets/budget_metrics.ts";
import { budgetRecords } from "./_budgets.ts";
import { createPrices, servedModels } from "../llm/prices.ts";
import { defaultModel, deploymentSpecs } from "../llm/deployment_specs.ts";
import { batchOfRun } from "../batches/batch_store.ts";
import { createTaskCache, type TaskCache } from "../tasks/task_cache.ts";
import { createSchemaValidators, VALIDATION_LIMITS } from "../tasks/validator.ts";
import { KEY_PREFIX, serviceKeys } from "../runs/keys.ts";
import { createAuthenticator } from "../tenants/authenticator.ts";
import { createRecipientPolicy } from "../tenants/mail_domains.ts";
import { createSecretCheck } from "../tenants/webhook_secrets.ts";
import { tenantChangeFeed } from "../tenants/tenant_changes.ts";
import { createWebhookHostPolicy } from "../tenants/webhook_hosts.ts";
import { startJobWaiter } from "../runs/job_waiter.ts";
import { buildFlows } from "./_model.ts";
import { replicaAckOf } from "./_replica_ack.ts";
import { problem } from "../http/problem.ts";
import { usageRoutes } from "../usage/usage_api.ts";
import { recordRefusal, refusalCounter } from "../metrics/refusals.ts";
import { REUSE_PORT_ARG } from "../launcher/parallel.ts";
import { installQueueGauges } from "./metrics_wiring.ts";
import { processMetrics } from "../metrics/process_metrics.ts";

/** What the API process's handler needs: the summary API's, and the console and `/metrics`. */
export interface ApiDeps extends SummaryApiDeps {
  /** The operator console (`/console`, ADMIN_TOKEN); without it, `/console` answers 404. */
  console?: (req: Request, path: string, client?: Client) => Promise<Response>;
  /**
   * Prometheus metrics; `/metrics` serves `registry` (which `dev` shares with
   * the worker and relay), behind `token` as a bearer token when it is set.
   */
  metrics?: { api: ApiMetrics; registry: Registry; token?: string };
  /** Task versions, read through a cache; one for this handler when unset. */
  tasks?: TaskCache;
  /** Validates run inputs against input schemas (`SchemaValidators`); validators of this handler's own when unset. */
  validate?: RunApiDeps["validate"];
  validateNow?: RunApiDeps["validateNow"];
  /** Checks new task definitions on a Worker; one of the task routes' own when unset. */
  definitions?: DefinitionChecker;
  /** A tenant's bytes of task definitions and rate of new versions (TASK_TENANT_MAX_BYTES, TASK_PUT...). */
  taskLimits?: Partial<TaskPutLimits>;
  /** The models a task may name (`servedModels`); any model when unset. */
  models?: ReadonlySet<string>;
  /** OPENAI_COMPAT_WAIT_S: how long the OpenAI-compatible endpoints wait for a run; 60 s when unset. */
  openAiWaitS?: number;
}

/**
 * The API process's routes: the summary API (`/v1/summaries...`), the
 * console (`/console...`), `/metrics`, `/openapi.json` and the health checks,
 * as a plain `(req, client) => Promise<Response>`, so tests can call it
 * without a port and `serveApi` hands it to `Deno.serve`.
 */
export function createApiHandler(apiDeps: ApiDeps): (req: Request, client?: Client) => Promise<Response> {
  // Every 429 a tenant is answered is counted for it (the console's usage chart): the tenant is the one its
  // request authenticated as, wherever the refusal was decided.
  // In flight only: each request's entry goes when it is answered (a WeakMap's entries cost the collector more).
  const tenants = new Map<Request, string>();
  const deps: ApiDeps = {
    ...apiDeps,
    authenticate: (req) =>
      apiDeps.authenticate(req).then((tenant) => {
        tenants.set(req, tenant);
        return tenant;
      }),
  };
  const { console: operatorConsole, metrics } = deps;
  const refusals = metrics && refusalCounter(metrics.registry);
  const own = deps.validate ? undefined : createSchemaValidators();
  const runs: RunApiDeps = {
    ...deps,
    tasks: deps.tasks ?? createTaskCache(deps.sql),
    validate: deps.validate ?? own!.validate,
    validateNow: deps.validate ? deps.validateNow : own!.validateNow,
  };
  const openApi = openApiDocument();
  const router = new Router()
    // Off (no ADMIN_TOKEN): indistinguishable from any unknown path. The peer's address (Deno.serve's
    // second argument) goes with a request to it, for the log of a failed sign-in.
    .mount(
      "/console",
      operatorConsole
        ? (req, { path, client }) => operatorConsole(req, path, client)
        : (req, { path }) => problem(404, `No route for ${req.method} ${path}`),
    )
    .route(summaryRoutes(deps))
    .route(taskRoutes({ ...runs, definitions: deps.definitions, taskLimits: deps.taskLimits, models: deps.models }))
    .route(runRoutes(runs))
    .route(openAiRoutes({ ...deps, models: deps.models, waitS: deps.openAiWaitS }))
    .route(usageRoutes(deps))
    .route(healthRoutes(deps))
    .on("/openapi.json", { GET: () => json(200, openApi) })
    .on("/metrics", {
      GET: (req) =>
        metrics
          ? metricsResponse(metrics.registry, { token: metrics.token, headers: req.headers })
          : problem(404, "Metrics are not enabled in this process"),
    });
  const handle = router.handler({ log: deps.log, metrics: metrics?.api });
  return async (req, client) => {
    let response: Response;
    let tenant: string | undefined;
    try {
      response = await handle(req, client);
    } finally {
      tenant = tenants.get(req);
      tenants.delete(req);
    }
    if (tenant !== undefined && response.status === 429) {
      recordRefusal(deps.redis, deps.keys, tenant, 429);
      refusals?.(tenant, 429);
    }
    return response;
  };
}

/**
 * Serves the API on HOST:PORT until `signal` aborts, then finishes in-flight requests. With `reusePort`
 * (`deno task api --parallel`), other processes may listen on the same port and share its connections.
 */
export async function serveApi(
  { config, redis, sql, log, registry }: ComponentDeps,
  signal: AbortSignal,
  { reusePort = false }: { reusePort?: boolean } = {},
): Promise<void> {
  const keys = serviceKeys(KEY_PREFIX);
  // The API serves the summed backlog too: an autoscaler that scaled the workers to zero still reads it.
  const backlog = installQueueGauges(registry, { redis, log }, { keys, writer: `api-${Deno.pid}` });
  // One LISTEN connection serves every `Prefer: wait` request of this process.
  const waiter = startJobWaiter({ sql, log }, signal);
  const flows = buildFlows(config, redis, log);
  // REDIS_MIN_REPLICAS_ACK: intake and the console's dead-letter replay answer only once the replicas have it.
  const ack = replicaAckOf(config, redis);
  const operatorConsole = config.ADMIN_TOKEN
    ? await (await import("../console/console.ts")).createConsole({
      redis,
      sql,
      keys,
      log,
      ack,
      token: config.ADMIN_TOKEN,
      maxBodyBytes: config.MAX_BODY_BYTES,
      batchDeployments: deploymentSpecs(config).filter((spec) => spec.batch).flatMap((spec) => spec.name ?? []),
      providerStatus: flows.length > 0
        ? (async () => {
          const { formatProviderStatuses } = await import("../cli/provider_command.ts");
          return await formatProviderStatuses(flows);
        })
        : undefined,
    })
    : undefined;
  // Run inputs are validated under a deadline: a tenant's schema cannot stall this process (`validator.ts`).
  const validators = createSchemaValidators({ keep: VALIDATION_LIMITS.workers });
  // New task definitions are compiled and checked on a Worker of their own, not on this thread.
  const definitions = createDefinitionChecker();
  // Which tenants' keys, lists or secrets changed: the request path's caches confirm the rest through it.
  const changes = tenantChangeFeed(sql);
  const handler = createApiHandler({
    validate: validators.validate,
    validateNow: validators.validateNow,
    definitions,
    models: servedModels(config),
    openAiWaitS: config.OPENAI_COMPAT_WAIT_S,
    taskLimits: {
      maxTenantBytes: config.TASK_TENANT_MAX_BYTES,
      putsPerMinute: config.TASK_PUTS_PER_MINUTE,
      putBurst: config.TASK_PUT_BURST,
    },
    console: operatorConsole,
    waiter,
    shutdown: signal,
    webhooks: {
      allowHttp: config.WEBHOOK_ALLOW_HTTP,
      allowPrivate: config.WEBHOOK_ALLOW_PRIVATE,
      hasSecret: createSecretCheck(sql, { signal, changes }),
      hosts: createWebhookHostPolicy({ sql }, { signal, changes }),
    },
    metrics: { api: apiMetrics(registry), registry, token: config.METRICS_TOKEN },
    redis,
    sql,
    log,
    authenticate: createAuthenticator({ sql }, {
      mode: config.AUTH_MODE,
      gatewaySecret: config.GATEWAY_SECRET,
      signal,
      changes,
    }),
    intake: createIntake({ redis, log, ack }, {
      maxQueued: config.INTAKE_MAX_QUEUED,
      maxQueuedPerTenant: config.INTAKE_MAX_QUEUED_PER_TENANT,
      keys,
      resultTtlS: config.IDEMPOTENCY_RESULT_TTL_S,
      path: SUMMARIES,
    }),
    keys,
    recipients: createRecipientPolicy({ sql }, { signal, changes }),
    maxBodyBytes: config.MAX_BODY_BYTES,
    bodies: config.TENANT_BODY_BYTES_IN_FLIGHT > 0
      ? createBodyAdmission(config.TENANT_BODY_BYTES_IN_FLIGHT)
      : undefined,
    budgets: createBudgets({ redis, log }, {
      keys,
      records: budgetRecords(sql),
      prices: createPrices(config),
      events: budgetEvents(registry),
    }),
    defaultModel: defaultModel(config),
    // One indexed read (`batch_runs`' primary key) per GET of a queued run.
    batchOf: (runId) => batchOfRun(sql, runId),
  });
  const server = Deno.serve({
    hostname: config.HOST,
    port: config.PORT,
    ...(reusePort ? { reusePort } : {}),
    onListen: ({ hostname, port }) => log.info("api_listening", { url: `http://${hostname}:${port}`, pid: Deno.pid }),
    // Anything the handler did not turn into a response: one JSON log line and a problem document, never
    // Deno's plain-text 500 with a stack trace on stderr.
    onError: (error) => {
      log.error("request_failed", { error });
      return problem(500, "Internal error");
    },
  }, handler);
  signal.addEventListener("abort", () => void server.shutdown(), { once: true });
  await server.finished;
  await backlog?.close();
  await waiter.close();
  await validators.close();
  await definitions.close();
  await ack?.close();
  log.info("api_stopped");
}

/**
 * `deno task api`; `main.ts api --reuse-port` is one of the processes of `deno task api --parallel`, started by
 * the launcher (`src/launcher/parallel.ts`).
 */
export async function runApi({ config, clients, log, shutdown, args }: RunContext<{ redis: true; sql: true }>) {
  const unknown = args.filter((arg) => arg !== REUSE_PORT_ARG);
  if (unknown.length > 0) {
    console.error(`Usage: deno task api [--parallel[=N]] (got ${JSON.stringify(unknown.join(" "))})`);
    return 2;
  }
  const reusePort = args.includes(REUSE_PORT_ARG);
  const registry = createRegistry();
  processMetrics(registry);
  await serveApi({ config, ...clients, log, registry }, shutdown(), { reusePort });
  return 0;
}
