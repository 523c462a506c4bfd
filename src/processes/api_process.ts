import type { RunContext } from "../commands.ts";
import type { ComponentDeps } from "./_deps.ts";
import { apiMetrics, createRegistry } from "../metrics/metrics.ts";
import { createHandler, SUMMARIES } from "../summaries/api.ts";
import { createIntake } from "../summaries/intake.ts";
import { KEY_PREFIX, serviceKeys } from "../summaries/keys.ts";
import { createAuthenticator } from "../tenants/authenticator.ts";
import { createRecipientPolicy } from "../tenants/mail_domains.ts";
import { createSecretCheck } from "../tenants/webhook_secrets.ts";
import { createWebhookHostPolicy } from "../tenants/webhook_hosts.ts";
import { startJobWaiter } from "../summaries/job_waiter.ts";
import { buildFlow, providerLabel } from "./_model.ts";
import { problem } from "../http/problem.ts";

/** Serves the API on HOST:PORT until `signal` aborts, then finishes in-flight requests. */
export async function serveApi(
  { config, redis, sql, log, registry }: ComponentDeps,
  signal: AbortSignal,
): Promise<void> {
  const keys = serviceKeys(KEY_PREFIX);
  // One LISTEN connection serves every `Prefer: wait` request of this process.
  const waiter = startJobWaiter({ sql, log }, signal);
  const flow = buildFlow(config, redis, log);
  const operatorConsole = config.ADMIN_TOKEN
    ? await (await import("../console/console.ts")).createConsole({
      redis,
      sql,
      keys,
      log,
      token: config.ADMIN_TOKEN,
      maxBodyBytes: config.MAX_BODY_BYTES,
      providerStatus: flow &&
        (async () => {
          const { formatProviderStatus } = await import("../cli/provider_command.ts");
          return formatProviderStatus(await flow.status(), providerLabel(config));
        }),
    })
    : undefined;
  const handler = createHandler({
    console: operatorConsole,
    waiter,
    shutdown: signal,
    webhooks: {
      allowHttp: config.WEBHOOK_ALLOW_HTTP,
      allowPrivate: config.WEBHOOK_ALLOW_PRIVATE,
      hasSecret: createSecretCheck(sql),
      hosts: createWebhookHostPolicy({ sql }),
    },
    metrics: { api: apiMetrics(registry), registry, token: config.METRICS_TOKEN },
    redis,
    sql,
    log,
    authenticate: createAuthenticator({ sql }, { mode: config.AUTH_MODE, gatewaySecret: config.GATEWAY_SECRET }),
    intake: createIntake({ redis, log }, {
      maxQueued: config.INTAKE_MAX_QUEUED,
      maxQueuedPerTenant: config.INTAKE_MAX_QUEUED_PER_TENANT,
      keys,
      resultTtlS: config.IDEMPOTENCY_RESULT_TTL_S,
      path: SUMMARIES,
    }),
    keys,
    recipients: createRecipientPolicy({ sql }),
    maxBodyBytes: config.MAX_BODY_BYTES,
  });
  const server = Deno.serve({
    hostname: config.HOST,
    port: config.PORT,
    onListen: ({ hostname, port }) => log.info("api_listening", { url: `http://${hostname}:${port}` }),
    // Anything the handler did not turn into a response: one JSON log line and a problem document, never
    // Deno's plain-text 500 with a stack trace on stderr.
    onError: (error) => {
      log.error("request_failed", { error });
      return problem(500, "Internal error");
    },
  }, handler);
  signal.addEventListener("abort", () => void server.shutdown(), { once: true });
  await server.finished;
  await waiter.close();
  log.info("api_stopped");
}

/** `deno task api`. */
export async function runApi({ config, clients, log, shutdown }: RunContext<{ redis: true; sql: true }>) {
  await serveApi({ config, ...clients, log, registry: createRegistry() }, shutdown());
  return 0;
}
