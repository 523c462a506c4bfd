/**
 * One place that builds the API handler, a summary worker and a relay the
 * way the processes do, with test-friendly defaults. Tests and the bench
 * pass their own clients and override only what they are about.
 */
import {
  type BudgetKeys,
  type BudgetRecords,
  type Budgets,
  type BudgetsOptions,
  createBudgets,
} from "../../src/budgets/budgets.ts";
import { budgetRecords as processBudgetRecords } from "../../src/processes/_budgets.ts";
import type { ReplicaAck } from "../../src/redis/replica_ack.ts";
import type { RedisClient } from "../../src/clients.ts";
import type { Sql } from "postgres";
import type { LLM } from "../../src/llm/llm.ts";
import type { Models } from "../../src/llm/models.ts";
import { silentLogger } from "../../src/log/logger.ts";
import type { Logger } from "../../src/log/logger.ts";
import { createResendMailer } from "../../src/mail/resend_mailer.ts";
import type { Mailer } from "../../src/mail/mailer.ts";
import { createRelay, type Deferral, type Relay, type RelayOptions } from "../../src/outbox/relay.ts";
import type { ProviderFlow } from "../../src/provider/flow_control.ts";
import { createDeployment } from "../../src/provider/deployment.ts";
import type { Prices } from "../../src/llm/prices.ts";
import type { StreamWorker } from "../../src/queue/stream_worker.ts";
import { type ApiDeps, createApiHandler } from "../../src/processes/api_process.ts";
import { SUMMARIES } from "../../src/summaries/api.ts";
import { pipelineNotifications } from "../../src/runs/notifications.ts";
import { summaryEmailRenderer, summaryPayloadLoader } from "../../src/summaries/email.ts";
import { createTaskCache, type TaskCache } from "../../src/tasks/task_cache.ts";
import { createSchemaValidators } from "../../src/tasks/validator.ts";
import { createIntake } from "../../src/runs/intake.ts";
import type { ServiceKeys } from "../../src/runs/keys.ts";
import { createSummaryWorker, type SummaryWorkerOptions } from "../../src/runs/worker.ts";
import type { SummaryJobDeps, SummaryJobOptions } from "../../src/runs/run_deps.ts";
import { createAuthenticator } from "../../src/tenants/authenticator.ts";
import { createSecretCheck } from "../../src/tenants/webhook_secrets.ts";
import { createWebhookHostPolicy } from "../../src/tenants/webhook_hosts.ts";
import type { WebhookUrlPolicy } from "../../src/webhooks/addresses.ts";

/** Tests deliver webhooks to receivers on loopback over http, which production refuses by default. */
export const LOCAL_WEBHOOKS: WebhookUrlPolicy = { allowHttp: true, allowPrivate: true };

/** The API handler on `redis` and `sql`; trusted-header auth unless `authMode` says otherwise. */
export function apiHandler(
  { redis, sql, keys, log = silentLogger }: { redis: RedisClient; sql: Sql; keys: ServiceKeys; log?: Logger },
  overrides: Partial<ApiDeps> & {
    authMode?: "api-key" | "trusted-header";
    /** 0 (the default here) looks every key up, so a revocation shows at once. */
    authCacheTtlMs?: number;
    resultTtlS?: number;
  } = {},
): (req: Request) => Promise<Response> {
  const { authMode = "trusted-header", authCacheTtlMs = 0, resultTtlS = 86_400, ...deps } = overrides;
  const handler = createApiHandler({
    redis,
    sql,
    log,
    authenticate: createAuthenticator({ sql }, {
      mode: authMode,
      cacheTtlMs: authCacheTtlMs,
      gatewaySecret: GATEWAY_SECRET_FOR_TESTS,
    }),
    intake: createIntake({ redis }, { keys, resultTtlS, path: SUMMARIES }),
    keys,
    maxBodyBytes: 1 << 20,
    webhooks: {
      ...LOCAL_WEBHOOKS,
      hasSecret: createSecretCheck(sql),
      hosts: createWebhookHostPolicy({ sql }, { ttlMs: 0 }),
    },
    ...deps,
  });
  if (authMode === "api-key") return handler;
  // Trusted-header tests play the gateway: every request carries its secret.
  return (req) => {
    if (req.headers.has("x-gateway-secret")) return handler(req);
    const headers = new Headers(req.headers);
    headers.set("x-gateway-secret", GATEWAY_SECRET_FOR_TESTS);
    return handler(new Request(req, { headers }));
  };
}

/** The gateway secret of trusted-header handlers built here. */
export const GATEWAY_SECRET_FOR_TESTS = "test-gateway-secret-0123456789";

/**
 * A tenant's client of `api`: each call sends its API key and `body` as JSON (none when undefined), and
 * returns the answer's status, headers and parsed JSON body.
 */
export function jsonClient(api: (req: Request) => Promise<Response>, key: string) {
  return async (method: string, path: string, body?: unknown, headers: Record<string, string> = {}) => {
    const res = await api(
      new Request(`http://api${path}`, {
        method,
        headers: { authorization: `Bearer ${key}`, "content-type": "application/json", ...headers },
        body: body === undefined ? undefined : JSON.stringify(body),
      }),
    );
    return { status: res.status, headers: res.headers, body: await res.json() };
  };
}

/**
 * A summary worker with short timings: redelivery after a minute, small budgets, fast backoff. Its calls go to
 * `models`, or else to one deployment of `llm` under `flow`, whose model is named `overrides.job.model`.
 */
export function summaryWorker(
  { redis, sql, llm, models, keys, flow, budgets, prices, tasks, validators, log = silentLogger }: {
    redis: RedisClient;
    sql: Sql;
    keys: ServiceKeys;
    flow?: ProviderFlow;
    /** The deployments; one of `llm` and `flow` when unset. */
    models?: Models;
    llm?: LLM;
    budgets?: Budgets;
    /** Model prices: each attempt's `cost_usd` (NULL without). */
    prices?: Prices;
    /** The task versions it runs; `sql`'s, with the built-in summarize, when unset. */
    tasks?: TaskCache;
    /** The output validators; a pool of their own, with the default limits, when unset. */
    validators?: SummaryJobDeps["validators"];
    log?: Logger;
  },
  overrides: Partial<Omit<SummaryWorkerOptions, "job">> & {
    /** `model`: the deployment's model, as attempts record it ("unknown" when unset). */
    job?: Partial<SummaryJobOptions> & { model?: string };
  } = {},
): StreamWorker {
  const { model = "unknown", ...job } = overrides.job ?? {};
  if (!models && !llm) throw new TypeError("summaryWorker needs `models` or `llm`");
  return createSummaryWorker({
    redis,
    sql,
    models: models ?? createDeployment({ llm: llm!, flow, model }),
    log,
    budgets,
    prices,
    tasks: tasks ?? createTaskCache(sql),
    validators: validators ?? createSchemaValidators(),
  }, {
    keys,
    consumer: "test",
    claimIdleMs: 60_000,
    maxDeliveries: 5,
    concurrency: 8,
    blockMs: 10,
    ...overrides,
    job: {
      budgetMs: 5_000,
      perCallTimeoutMs: 2_000,
      maxAttempts: 4,
      backoffBaseMs: 1,
      backoffCapMs: 5,
      ...job,
    },
  });
}

/** A relay to a Resend-compatible server at `mailUrl` (or any mailer), and to webhook receivers under `webhookPolicy`. */
export function relayTo(
  { sql, mailUrl, mailer, defer, webhookPolicy = LOCAL_WEBHOOKS, webhookTimeoutMs = 2_000, log = silentLogger }: {
    sql: Sql;
    mailUrl?: string;
    mailer?: Mailer;
    defer?: Deferral;
    webhookPolicy?: WebhookUrlPolicy;
    webhookTimeoutMs?: number;
    log?: Logger;
  },
  overrides: Partial<RelayOptions> = {},
): Relay {
  const notifications = pipelineNotifications({
    sql,
    from: "summaries@example.com",
    policy: webhookPolicy,
    timeoutMs: webhookTimeoutMs,
    summaries: { render: summaryEmailRenderer("summaries@example.com"), load: summaryPayloadLoader(sql) },
  });
  return createRelay({
    sql,
    mailer: mailer ??
      createResendMailer({ apiKey: "re_test", baseUrl: mailUrl ?? "http://127.0.0.1:9", timeoutMs: 2_000 }),
    ...notifications,
    defer,
    log,
  }, { batch: 20, maxAttempts: 5, leaseMs: 5_000, ...overrides });
}

/** What the budgets read from `sql`, from the stores that own it, as the processes wire it. */
export function budgetRecords(sql: Sql): BudgetRecords {
  return processBudgetRecords(sql);
}

/** A process's budgets on `redis`, reading limits and spend from `sql` as the processes do. */
export function budgetsOn(
  { redis, sql, keys, ack, log = silentLogger }: {
    redis: RedisClient;
    sql: Sql;
    keys: BudgetKeys;
    ack?: ReplicaAck;
    log?: Logger;
  },
  options: Omit<BudgetsOptions, "keys" | "records">,
): Budgets {
  return createBudgets({ redis, log, ack }, { keys, records: budgetRecords(sql), ...options });
}
