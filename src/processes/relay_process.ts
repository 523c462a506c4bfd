import { CHANGES_KEPT_MS } from "../tenants/tenant_changes.ts";
import type { RunContext } from "./run_context.ts";
import { createRegistry, relayMetrics } from "../metrics/metrics.ts";
import { processMetrics } from "../metrics/process_metrics.ts";
import { outboxGauges, relayEvents } from "./metrics_wiring.ts";
import { createRelay } from "../outbox/relay.ts";
import { createRetention } from "../retention/retention.ts";
import { DEAD_LETTER_BOUNDS } from "../queue/dead_letter.ts";
import { JOB_RECORD_TTL_S } from "../runs/keys.ts";
import { summaryEmailRenderer, summaryPayloadLoader, tenantHourlyLimits } from "../summaries/email.ts";
import { SUMMARY_READY_TOPIC, SUMMARY_WEBHOOK_TOPIC } from "../runs/shapes.ts";
import { pipelineNotifications } from "../runs/notifications.ts";
import { connectPostgres, DependencyDown } from "../clients.ts";
import { sleep } from "../async/timeout.ts";
import type { Sql } from "postgres";
import { buildMailer } from "./_mailer.ts";
import { maybeServeMetrics } from "./_metrics_port.ts";
import { ready } from "../http/health.ts";
import type { ComponentDeps } from "./_deps.ts";

/** Runs the outbox relay until `signal` aborts, then finishes its current batch. */
export async function startRelay(
  { config, sql, log, registry }: Omit<ComponentDeps, "redis">,
  signal: AbortSignal,
): Promise<void> {
  outboxGauges(registry, sql);
  const sendTimeoutMs = config.MAIL_SEND_TIMEOUT_S * 1000;
  const notifications = pipelineNotifications({
    sql,
    from: config.MAIL_FROM,
    policy: { allowHttp: config.WEBHOOK_ALLOW_HTTP, allowPrivate: config.WEBHOOK_ALLOW_PRIVATE },
    timeoutMs: sendTimeoutMs,
    summaries: { render: summaryEmailRenderer(config.MAIL_FROM), load: summaryPayloadLoader(sql) },
  });
  const relay = createRelay({
    sql,
    mailer: buildMailer(config),
    ...notifications,
    defer: config.MAIL_TENANT_HOURLY_LIMIT === undefined && config.WEBHOOK_TENANT_HOURLY_LIMIT === undefined
      ? undefined
      : tenantHourlyLimits(sql, {
        [SUMMARY_READY_TOPIC]: config.MAIL_TENANT_HOURLY_LIMIT,
        [SUMMARY_WEBHOOK_TOPIC]: config.WEBHOOK_TENANT_HOURLY_LIMIT,
      }),
    log,
  }, {
    batch: config.RELAY_BATCH,
    maxAttempts: config.RELAY_MAX_ATTEMPTS,
    // A row is claimed just before its send starts; its lease must outlast that one send (DNS, connect and
    // answer, all capped by the send timeout) plus recording its outcome, with room for a stalled event loop.
    leaseMs: 2 * sendTimeoutMs + 5_000,
    events: relayEvents(relayMetrics(registry)),
  });
  log.info("relay_started", { mail: config.MAIL_PROVIDER, batch: config.RELAY_BATCH });
  await relay.run(signal);
  log.info("relay_stopped");
}

/**
 * The least age at which a job's outcome row is deleted: as long as anything may still ask about the job, plus a
 * day. That is its Redis status record ({@linkcode JOB_RECORD_TTL_S}) and its dead letters
 * ({@linkcode DEAD_LETTER_BOUNDS}.maxAgeS), both 7 days. A dead letter's replay reads the outcome to refuse a job
 * that already had its effects, and a job is decided (failed) before it is dead-lettered, so its outcome always
 * outlives its dead letters.
 */
export const OUTCOME_MIN_AGE_MS = (Math.max(JOB_RECORD_TTL_S, DEAD_LETTER_BOUNDS.maxAgeS) * 1000) + 24 * 3600 * 1000;

/** Seconds between retention's tries to connect while Postgres does not answer. */
export const RETENTION_CONNECT_RETRY_S = 30;

/**
 * Runs retention until `signal` aborts, then waits for a pass in progress. Relay processes run it beside the
 * relay, not in its send loop (and `dev`, once): one pass runs at a time across them all.
 *
 * Its passes run on a Postgres client of one connection of its own, not on the process's pool `sql`: a pass's
 * lock is a session lock, and a connection reserved from the pool is one that postgres.js 3.4.9 crashes the
 * process on once its backend has died (porsager/postgres#1208), as backends do in a failover. The connection
 * closes when idle (`connectPostgres`'s idle timeout), so between passes it holds nothing.
 * While Postgres does not answer at start, it asks again every {@linkcode RETENTION_CONNECT_RETRY_S} seconds.
 */
export async function startRetention(
  { config, log }: Pick<ComponentDeps, "config" | "log">,
  signal: AbortSignal,
): Promise<void> {
  // Never replaced on a timer (a pass's lock lives on its connection), and asked again while Postgres does not
  // answer at start: retention waiting for Postgres must not take the relay down with it.
  let sql: Sql | undefined;
  while (!sql) {
    try {
      sql = await connectPostgres(config.DATABASE_URL, { max: 1, maxLifetimeS: null });
    } catch (error) {
      if (!(error instanceof DependencyDown)) throw error;
      log.warn("retention_connect_failed", { error, retry_in_s: RETENTION_CONNECT_RETRY_S });
      await sleep(RETENTION_CONNECT_RETRY_S * 1000, signal).catch(() => {});
      if (signal.aborted) return;
    }
  }
  try {
    const retention = createRetention({ sql, log }, {
      outboxRetentionMs: config.OUTBOX_RETENTION_S * 1000,
      summaryRetentionMs: config.SUMMARY_RETENTION_S === undefined ? undefined : config.SUMMARY_RETENTION_S * 1000,
      attemptRetentionMs: config.MODEL_ATTEMPTS_RETENTION_S * 1000,
      outcomeMinAgeMs: OUTCOME_MIN_AGE_MS,
      tenantChangesRetentionMs: CHANGES_KEPT_MS,
    });
    retention.start();
    if (!signal.aborted) await new Promise((resolve) => signal.addEventListener("abort", resolve, { once: true }));
    await retention.stop();
  } finally {
    await sql.end({ timeout: 5 });
  }
}

/** `deno task relay`: the relay, and retention beside it. */
export async function runRelay({ config, clients, log, shutdown }: RunContext<{ sql: true }>) {
  const signal = shutdown();
  const registry = createRegistry();
  processMetrics(registry);
  maybeServeMetrics(config, registry, signal, () => ready({ sql: clients.sql, log }));
  await Promise.all([
    startRelay({ config, sql: clients.sql, log, registry }, signal),
    startRetention({ config, log }, signal),
  ]);
  return 0;
}
