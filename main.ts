/**
 * Oncely's entry point: the only module that reads the environment. It parses
 * the configuration once, builds clients, picks the process to run, and
 * installs signal handlers. Everything else takes its dependencies as
 * parameters.
 */
import type { Redis } from "ioredis";
import type { Sql } from "postgres";
import { connectPostgres, connectRedis, DependencyDown } from "./src/clients.ts";
import { dlqCommand } from "./src/cli/dlq_command.ts";
import { outboxCommand } from "./src/cli/outbox_command.ts";
import { providerCommand } from "./src/cli/provider_command.ts";
import { tenantCommand } from "./src/cli/tenant_command.ts";
import { type Config, CONFIG_VARIABLES, ConfigError, parseConfig } from "./src/config.ts";
import { migrate, MIGRATIONS_DIR, readMigrations } from "./src/db/migrate.ts";
import { createIdempotencyStore } from "./src/idempotency/idempotency_store.ts";
import { createExtractiveLlm } from "./src/llm/extractive.ts";
import type { LLM } from "./src/llm/llm.ts";
import { createOpenAiLlm } from "./src/llm/openai_llm.ts";
import { createLogger, type Logger } from "./src/log/logger.ts";
import { createLogMailer } from "./src/mail/log_mailer.ts";
import type { Mailer } from "./src/mail/mailer.ts";
import { createResendMailer } from "./src/mail/resend_mailer.ts";
import { createRelay } from "./src/outbox/relay.ts";
import type { Registry } from "prom-client";
import { apiMetrics, createRegistry, relayMetrics, serveMetrics, workerMetrics } from "./src/metrics/metrics.ts";
import {
  attemptObserver,
  flowEvents,
  outboxGauges,
  providerGauges,
  queueGauges,
  relayEvents,
  workerEvents,
} from "./src/metrics/wire.ts";
import {
  createProviderFlow,
  type FlowEvents,
  type ProviderFlow,
  providerStateKey,
} from "./src/provider/flow_control.ts";
import { type Command, COMMANDS, missingNetPermissions, NEEDS, permissionFlags } from "./src/permissions.ts";
import { createHandler } from "./src/summaries/api.ts";
import { jobKeys } from "./src/summaries/keys.ts";
import { summaryEmailRenderer } from "./src/summaries/email.ts";
import { createSummaryWorker } from "./src/summaries/worker.ts";
import { createAuthenticator } from "./src/tenants/authenticator.ts";
import { createApiKey, tenantExists } from "./src/tenants/tenant_store.ts";

const USAGE = `Usage: deno task <${COMMANDS.join("|")}> [args]`;
const REDIS_PREFIX = "oncely";
const GRACE_MS = 8_000;

/** Reads exactly the variables the service knows, so the env permission can list them. */
function readEnv(): Record<string, string | undefined> {
  return Object.fromEntries(CONFIG_VARIABLES.map((name) => [name, Deno.env.get(name)]));
}

/** An AbortSignal that fires on SIGTERM or SIGINT; a second signal, or the grace period, forces exit 0. */
function shutdownSignal(log: Logger): AbortSignal {
  const controller = new AbortController();
  const onSignal = (signal: Deno.Signal) => () => {
    if (controller.signal.aborted) Deno.exit(0);
    log.info("shutdown_requested", { signal });
    controller.abort(new Error(`received ${signal}`));
    // The contract promises exit within 10 s; in-flight work left now stays pending and is reclaimed.
    setTimeout(() => {
      log.warn("shutdown_forced", { after_ms: GRACE_MS });
      Deno.exit(0);
    }, GRACE_MS).unref?.();
  };
  for (const signal of ["SIGTERM", "SIGINT"] as const) Deno.addSignalListener(signal, onSignal(signal));
  // Launched by `deno task`: if the launcher is killed outright, stop gracefully rather than run orphaned.
  const parent = Deno.ppid;
  const watch = setInterval(() => {
    if (Deno.ppid !== parent && !controller.signal.aborted) onSignal("SIGTERM")();
  }, 1_000);
  Deno.unrefTimer(watch);
  return controller.signal;
}

interface Clients {
  redis: Redis;
  sql: Sql;
}

async function withClients<T>(
  config: Config,
  needs: { redis?: boolean; sql?: boolean; failFast?: boolean },
  run: (clients: Partial<Clients>) => Promise<T>,
): Promise<T> {
  const clients: Partial<Clients> = {};
  try {
    if (needs.sql) clients.sql = await connectPostgres(config.DATABASE_URL);
    if (needs.redis) clients.redis = await connectRedis(config.REDIS_URL, { name: "oncely", failFast: needs.failFast });
    return await run(clients);
  } finally {
    await clients.sql?.end({ timeout: 5 });
    await clients.redis?.quit().catch(() => clients.redis?.disconnect());
  }
}

async function serveApi(
  config: Config,
  { redis, sql }: Clients,
  log: Logger,
  signal: AbortSignal,
  registry: Registry,
): Promise<void> {
  const handler = createHandler({
    metrics: { api: apiMetrics(registry), registry, token: config.METRICS_TOKEN },
    redis,
    sql,
    log,
    authenticate: createAuthenticator({ sql }, { mode: config.AUTH_MODE }),
    idempotency: createIdempotencyStore({ redis, log }, {
      prefix: REDIS_PREFIX,
      lockTtlS: config.IDEMPOTENCY_LOCK_TTL_S,
      resultTtlS: config.IDEMPOTENCY_RESULT_TTL_S,
    }),
    keys: jobKeys(REDIS_PREFIX),
    maxBodyBytes: config.MAX_BODY_BYTES,
  });
  const server = Deno.serve({
    hostname: config.HOST,
    port: config.PORT,
    onListen: ({ hostname, port }) => log.info("api_listening", { url: `http://${hostname}:${port}` }),
  }, handler);
  signal.addEventListener("abort", () => void server.shutdown(), { once: true });
  await server.finished;
  log.info("api_stopped");
}

function buildLlm(config: Config): LLM {
  if (config.LLM_PROVIDER === "extractive") return createExtractiveLlm();
  return createOpenAiLlm({
    apiKey: config.OPENAI_API_KEY!,
    model: config.OPENAI_MODEL,
    baseURL: config.OPENAI_BASE_URL,
  });
}

const DEFAULT_OPENAI_BASE_URL = "https://api.openai.com/v1";

/** The provider as people name it: base URL and model (never the key). */
function providerLabel(config: Config): string {
  if (config.LLM_PROVIDER === "extractive") return "extractive";
  return `${config.OPENAI_BASE_URL ?? DEFAULT_OPENAI_BASE_URL} ${config.OPENAI_MODEL}`;
}

/**
 * The shared limiter and breaker of the configured provider; none for the
 * local extractive model, which has no limits and cannot be down.
 */
function buildFlow(config: Config, redis: Redis, log: Logger, events?: FlowEvents): ProviderFlow | undefined {
  if (config.LLM_PROVIDER === "extractive") return undefined;
  return createProviderFlow({ redis, log }, {
    key: providerStateKey(REDIS_PREFIX, {
      baseURL: config.OPENAI_BASE_URL ?? DEFAULT_OPENAI_BASE_URL,
      model: config.OPENAI_MODEL,
      apiKey: config.OPENAI_API_KEY!,
    }),
    rpm: config.LLM_RPM,
    tpm: config.LLM_TPM,
    cooldownMs: config.LLM_BREAKER_COOLDOWN_S * 1000,
    // A probe holds the single slot for at most one call's timeout, plus slack.
    probeLeaseMs: config.LLM_CALL_TIMEOUT_S * 1000 + 5_000,
    events,
  });
}

/** Serves a standalone process's /metrics on METRICS_PORT, when set. */
function maybeServeMetrics(config: Config, registry: Registry, signal: AbortSignal): void {
  if (config.METRICS_PORT === undefined) return;
  serveMetrics(registry, { hostname: config.HOST, port: config.METRICS_PORT, signal, token: config.METRICS_TOKEN });
}

async function runWorker(
  config: Config,
  { redis, sql }: Clients,
  log: Logger,
  signal: AbortSignal,
  registry: Registry,
): Promise<void> {
  const metrics = workerMetrics(registry);
  const keys = jobKeys(REDIS_PREFIX);
  queueGauges(registry, redis, keys);
  const consumer = `${Deno.hostname()}-${Deno.pid}-${crypto.randomUUID().slice(0, 6)}`;
  const flow = buildFlow(config, redis, log, flowEvents(metrics));
  if (flow) providerGauges(registry, flow, providerLabel(config));
  const worker = createSummaryWorker({ redis, sql, llm: buildLlm(config), log, flow }, {
    keys,
    events: workerEvents(metrics),
    consumer,
    claimIdleMs: config.CLAIM_IDLE_MS,
    maxDeliveries: config.MAX_DELIVERIES,
    concurrency: config.WORKER_CONCURRENCY,
    graceMs: 5_000,
    job: {
      budgetMs: config.JOB_BUDGET_S * 1000,
      perCallTimeoutMs: config.LLM_CALL_TIMEOUT_S * 1000,
      maxAttempts: config.LLM_MAX_ATTEMPTS,
      onAttempt: attemptObserver(metrics),
    },
  });
  log.info("worker_started", {
    consumer,
    concurrency: config.WORKER_CONCURRENCY,
    llm: config.LLM_PROVIDER,
    rpm: config.LLM_RPM ?? (flow ? "from headers" : "unlimited"),
    tpm: config.LLM_TPM ?? (flow ? "from headers" : "unlimited"),
  });
  try {
    await worker.run(signal);
  } finally {
    await worker.close();
    log.info("worker_stopped", { consumer });
  }
}

function buildMailer(config: Config): Mailer {
  if (config.MAIL_PROVIDER === "log") return createLogMailer();
  return createResendMailer({
    apiKey: config.RESEND_API_KEY!,
    baseUrl: config.RESEND_BASE_URL,
    timeoutMs: config.MAIL_SEND_TIMEOUT_S * 1000,
  });
}

async function runRelay(config: Config, sql: Sql, log: Logger, signal: AbortSignal, registry: Registry): Promise<void> {
  outboxGauges(registry, sql);
  const sendTimeoutMs = config.MAIL_SEND_TIMEOUT_S * 1000;
  const relay = createRelay({ sql, mailer: buildMailer(config), render: summaryEmailRenderer(config.MAIL_FROM), log }, {
    batch: config.RELAY_BATCH,
    maxAttempts: config.RELAY_MAX_ATTEMPTS,
    // The lease must outlast a batch's concurrent sends (each capped by the send timeout) plus the commit.
    leaseMs: 2 * sendTimeoutMs + 5_000,
    retentionMs: config.OUTBOX_RETENTION_S * 1000,
    events: relayEvents(relayMetrics(registry)),
  });
  log.info("relay_started", { mail: config.MAIL_PROVIDER, batch: config.RELAY_BATCH });
  await relay.run(signal);
  log.info("relay_stopped");
}

async function ensureDevTenant(sql: Sql, config: Config): Promise<void> {
  if (config.AUTH_MODE !== "api-key" || await tenantExists(sql, "dev")) {
    console.log('Tenant "dev" exists. For a new key: deno task tenant create dev');
    return;
  }
  const key = await createApiKey(sql, "dev");
  const demoKey = `demo-${crypto.randomUUID().slice(0, 13)}`;
  const base = `http://${config.HOST.includes(":") ? `[${config.HOST}]` : config.HOST}:${config.PORT}`;
  console.log(`
Created tenant "dev". Its API key (shown once): ${key}

Submit a job:
  curl -i ${base}/v1/summaries \\
    -H 'Authorization: Bearer ${key}' \\
    -H 'Idempotency-Key: ${demoKey}' \\
    -H 'Content-Type: application/json' \\
    -d '{"text": "Oncely accepts each job once. Workers call the model and commit the summary with an outbox row. A relay emails it.", "notify": "you@example.com"}'

Run it twice: the second answer carries Idempotent-Replayed: true.
`);
}

async function run(command: Command, args: string[], config: Config, log: Logger): Promise<number> {
  switch (command) {
    case "migrate":
      return await withClients(config, { sql: true }, async ({ sql }) => {
        const applied = await migrate({ sql: sql!, log }, await readMigrations());
        console.log(applied.length ? `Applied ${applied.join(", ")}` : "Database is up to date");
        return 0;
      });
    case "tenant":
      return await withClients(config, { sql: true }, ({ sql }) => tenantCommand(sql!, args));
    case "api":
      return await withClients(config, { sql: true, redis: true, failFast: true }, async (clients) => {
        await serveApi(config, clients as Clients, log, shutdownSignal(log), createRegistry());
        return 0;
      });
    case "dev":
      return await withClients(config, { sql: true, redis: true }, async (clients) => {
        await migrate({ sql: clients.sql!, log }, await readMigrations());
        await ensureDevTenant(clients.sql!, config);
        const signal = shutdownSignal(log);
        // One registry: the API's /metrics shows all three components.
        const registry = createRegistry();
        await Promise.all([
          serveApi(config, clients as Clients, log.child({ component: "api" }), signal, registry),
          runWorker(config, clients as Clients, log.child({ component: "worker" }), signal, registry),
          runRelay(config, clients.sql!, log.child({ component: "relay" }), signal, registry),
        ]);
        return 0;
      });
    case "worker":
      return await withClients(config, { sql: true, redis: true }, async (clients) => {
        const signal = shutdownSignal(log);
        const registry = createRegistry();
        maybeServeMetrics(config, registry, signal);
        await runWorker(config, clients as Clients, log, signal, registry);
        return 0;
      });
    case "dlq":
      return await withClients(
        config,
        { redis: true },
        ({ redis }) => dlqCommand(redis!, jobKeys(REDIS_PREFIX), args, { isTerminal: Deno.stdout.isTerminal() }),
      );
    case "provider":
      return await withClients(
        config,
        { redis: true },
        ({ redis }) => providerCommand(buildFlow(config, redis!, log), providerLabel(config), args),
      );
    case "relay":
      return await withClients(config, { sql: true }, async ({ sql }) => {
        const signal = shutdownSignal(log);
        const registry = createRegistry();
        maybeServeMetrics(config, registry, signal);
        await runRelay(config, sql!, log, signal, registry);
        return 0;
      });
    case "outbox":
      return await withClients(config, { sql: true }, ({ sql }) => outboxCommand(sql!, args));
  }
}

/**
 * `main.ts launch <command>`: what `deno task <command>` runs. It derives the
 * command's permission set from the configured URLs (so HOST/PORT and every
 * URL may point anywhere, and the process may still reach nothing else),
 * runs `deno run <flags> main.ts <command>`, forwards SIGTERM/SIGINT, and
 * exits with the child's code.
 */
async function launch(command: Command, args: string[], config: Config): Promise<number> {
  const flags = permissionFlags(command, config, decodeURIComponent(MIGRATIONS_DIR.pathname));
  const child = new Deno.Command("deno", {
    args: ["run", ...flags, decodeURIComponent(new URL(import.meta.url).pathname), command, ...args],
    stdin: "inherit",
    stdout: "inherit",
    stderr: "inherit",
  }).spawn();
  const forward = (signal: Deno.Signal) => () => {
    try {
      child.kill(signal);
    } catch { /* already gone */ }
  };
  const handlers = (["SIGTERM", "SIGINT"] as const).map((signal) => {
    const handler = forward(signal);
    Deno.addSignalListener(signal, handler);
    return [signal, handler] as const;
  });
  const status = await child.status;
  for (const [signal, handler] of handlers) Deno.removeSignalListener(signal, handler);
  return status.code;
}

async function main(argv: string[]): Promise<number> {
  const launching = argv[0] === "launch";
  const [command, ...args] = launching ? argv.slice(1) : argv;
  if (!COMMANDS.includes(command as Command)) {
    console.error(USAGE);
    return 2;
  }
  let config: Config;
  try {
    config = parseConfig(readEnv());
  } catch (error) {
    if (error instanceof ConfigError) {
      console.error(error.message);
      return 2;
    }
    throw error;
  }
  if (launching) return await launch(command as Command, args, config);
  const denied = missingNetPermissions(command!, config, NEEDS[command as Command]);
  if (denied.length > 0) {
    console.error(denied[0]);
    return 2;
  }
  const log = createLogger({ level: config.LOG_LEVEL }).child({ process: command });
  try {
    return await run(command as Command, args, config, log);
  } catch (error) {
    if (error instanceof DependencyDown) {
      console.error(error.message);
      return 1;
    }
    throw error;
  }
}

if (import.meta.main) Deno.exit(await main(Deno.args));
