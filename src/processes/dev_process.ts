import type { Sql } from "postgres";
import type { RunContext } from "./run_context.ts";
import type { Config } from "../config.ts";
import { migrate, readMigrations } from "../db/migrate.ts";
import { createRegistry } from "../metrics/metrics.ts";
import { processMetrics } from "../metrics/process_metrics.ts";
import { createApiKey, tenantExists } from "../tenants/tenant_store.ts";
import { ensureWebhookSecret } from "../tenants/webhook_secrets.ts";
import { serveApi } from "./api_process.ts";
import { startRelay, startRetention } from "./relay_process.ts";
import { startWorker } from "./worker_process.ts";

async function ensureDevTenant(sql: Sql, config: Config): Promise<void> {
  if (config.AUTH_MODE !== "api-key" || await tenantExists(sql, "dev")) {
    console.log('Tenant "dev" exists. For a new key: deno task tenant create dev');
    return;
  }
  const key = await createApiKey(sql, "dev");
  const secret = await ensureWebhookSecret(sql, "dev");
  const demoKey = `demo-${crypto.randomUUID().slice(0, 13)}`;
  const base = `http://${config.HOST.includes(":") ? `[${config.HOST}]` : config.HOST}:${config.PORT}`;
  console.log(`
Created tenant "dev". Its API key (shown once): ${key}
Its webhook signing secret (shown once): ${secret}

Submit a job:
  curl -i ${base}/v1/summaries \\
    -H 'Authorization: Bearer ${key}' \\
    -H 'Idempotency-Key: ${demoKey}' \\
    -H 'Content-Type: application/json' \\
    -d '{"text": "Oncely accepts each job once. Workers call the model and commit the summary with an outbox row. A relay emails it.", "notify": "you@example.com"}'

Run it twice: the second answer carries Idempotent-Replayed: true. Add -H 'Prefer: wait=10' to get the
summary in the answer, or send "notify": {"webhook": "https://..."} to have it POSTed to you, signed.
`);
}

/** `deno task dev`: migrate, then the API, a worker, a relay and retention in one process, sharing one /metrics. */
export async function runDev({ config, clients, log, shutdown }: RunContext<{ redis: true; sql: true }>) {
  await migrate({ sql: clients.sql, log }, await readMigrations());
  await ensureDevTenant(clients.sql, config);
  const signal = shutdown();
  const registry = createRegistry();
  processMetrics(registry);
  await Promise.all([
    serveApi({ config, ...clients, log: log.child({ component: "api" }), registry }, signal),
    startWorker({ config, ...clients, log: log.child({ component: "worker" }), registry }, signal),
    startRelay({ config, sql: clients.sql, log: log.child({ component: "relay" }), registry }, signal),
    startRetention({ config, log: log.child({ component: "retention" }) }, signal),
  ]);
  return 0;
}
