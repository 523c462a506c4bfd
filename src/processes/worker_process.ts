import type { RunContext } from "./run_context.ts";
import { createRegistry, resultCacheMetrics, workerMetrics } from "../metrics/metrics.ts";
import {
  attemptObserver,
  flowEvents,
  installQueueGauges,
  providerGauges,
  resultCacheEvents,
  workerEvents,
} from "./metrics_wiring.ts";
import { processMetrics } from "../metrics/process_metrics.ts";
import { KEY_PREFIX, serviceKeys } from "../runs/keys.ts";
import { createSummaryWorker } from "../runs/worker.ts";
import { createTaskCache } from "../tasks/task_cache.ts";
import { createPrices } from "../llm/prices.ts";
import { createSchemaValidators, VALIDATION_LIMITS } from "../tasks/validator.ts";
import { buildFlows, buildModels } from "./_model.ts";
import { settlesWithin } from "../async/timeout.ts";
import type { ProviderFlow } from "../provider/flow_control.ts";
import { maybeServeMetrics } from "./_metrics_port.ts";
import { ready } from "../http/health.ts";
import type { ComponentDeps } from "./_deps.ts";
import { createBudgets, warnUnpricedModels } from "../budgets/budgets.ts";
import { budgetEvents } from "../budgets/budget_metrics.ts";
import { replicaAckOf } from "./_replica_ack.ts";
import { budgetRecords } from "./_budgets.ts";
import { taskModels } from "../jobs/task_store.ts";
import { type BatchTimings, buildBatches } from "./_batches.ts";

/** Options a test may give {@linkcode startWorker}. */
export interface WorkerProcessOptions {
  /** Shorter intervals of the batch services (their defaults otherwise). */
  batchTimings?: BatchTimings;
}

/** Runs a summary worker until `signal` aborts, then drains it within the grace period. */
export async function startWorker(
  { config, redis, sql, log, registry }: ComponentDeps,
  signal: AbortSignal,
  options: WorkerProcessOptions = {},
): Promise<void> {
  const metrics = workerMetrics(registry, { unlabelledFlows: !config.LLM_DEPLOYMENTS });
  const keys = serviceKeys(KEY_PREFIX);
  const consumer = `${Deno.hostname()}-${Deno.pid}-${crypto.randomUUID().slice(0, 6)}`;
  // The summed backlog and the oldest run's age: a snapshot one process walks per interval, never a scrape.
  const backlog = installQueueGauges(registry, { redis, log }, { keys, writer: consumer });
  const flows = buildFlows(config, redis, log, (deployment) => flowEvents(metrics, deployment));
  providerGauges(registry, flows);
  // Model answers are validated under a deadline: a tenant's output schema cannot stall this process.
  const validators = createSchemaValidators({ keep: VALIDATION_LIMITS.workers });
  const prices = createPrices(config);
  // REDIS_MIN_REPLICAS_ACK: a call goes out only under a reservation the replicas have, so a promotion keeps it.
  const ack = replicaAckOf(config, redis);
  const records = budgetRecords(sql);
  const budgets = createBudgets({ redis, log, ack }, { keys, records, prices, events: budgetEvents(registry) });
  await warnUnpricedModels({ log, records, taskModels: () => taskModels(sql) }, config, prices);
  // Runs with priority "batch" go through a provider batch when some deployment is marked "batch": true.
  const batches = buildBatches(
    { config, sql, redis, log, keys, prices, budgets, registry, ack },
    options.batchTimings,
  );
  const worker = createSummaryWorker({
    redis,
    sql,
    models: buildModels(config, { flows, log }),
    log,
    tasks: createTaskCache(sql),
    validators,
    budgets,
    prices,
    batches: batches?.intake,
    // A run with an expiry sends its first attempt only once the replicas have its `started` mark.
    ack,
  }, {
    keys,
    events: workerEvents(metrics, { concurrency: config.WORKER_CONCURRENCY }),
    consumer,
    claimIdleMs: config.CLAIM_IDLE_MS,
    maxDeliveries: config.MAX_DELIVERIES,
    concurrency: config.WORKER_CONCURRENCY,
    tenantMaxInFlight: config.TENANT_MAX_IN_FLIGHT,
    graceMs: 5_000,
    job: {
      budgetMs: config.JOB_BUDGET_S * 1000,
      perCallTimeoutMs: config.LLM_CALL_TIMEOUT_S * 1000,
      maxAttempts: config.LLM_MAX_ATTEMPTS,
      onAttempt: attemptObserver(metrics),
    },
    cache: {
      defaultTtlS: config.RESULT_CACHE_TTL_S,
      prices,
      events: resultCacheEvents(resultCacheMetrics(registry)),
    },
  });
  log.info("worker_started", {
    consumer,
    concurrency: config.WORKER_CONCURRENCY,
    llm: config.LLM_PROVIDER,
    deployments: flows.length ? flows.map((f) => f.label) : undefined,
    rpm: config.LLM_RPM ?? (flows.length ? "from headers" : "unlimited"),
    tpm: config.LLM_TPM ?? (flows.length ? "from headers" : "unlimited"),
    batch_deployments: batches?.deployments,
  });
  // The submitter and the poller: each finishes the batch step in hand once `signal` aborts.
  const batchLoops = batches?.run(signal);
  try {
    await worker.run(signal);
  } finally {
    // A step still running past the grace is left as a crash would leave it: the next process resumes it.
    if (batchLoops && !(await settlesWithin(batchLoops, BATCH_STOP_MS))) {
      log.warn("batch_step_unfinished", { waited_ms: BATCH_STOP_MS });
    }
    await worker.close();
    await backlog?.close();
    // Successes are reported to the shared limiter in the background: the last of them land before the exit,
    // unless Redis does not answer (a report lost only leaves the limiter a little ahead of what was spent).
    const all = <T>(each: (flow: ProviderFlow) => Promise<T>) => Promise.all(flows.map((f) => each(f.flow)));
    if (!(await settlesWithin(all((flow) => flow.settled()), FLOW_SETTLE_MS))) {
      log.warn("flow_reports_unsettled", { waited_ms: FLOW_SETTLE_MS });
    }
    // Its configured limits stop counting for the other processes now, not when their entry expires.
    if (!(await settlesWithin(all((flow) => flow.withdraw()), FLOW_SETTLE_MS))) {
      log.warn("flow_config_not_withdrawn", { waited_ms: FLOW_SETTLE_MS });
    }
    await validators.close();
    await ack?.close();
    log.info("worker_stopped", { consumer });
  }
}

/** How long a stopping worker waits, after its runs, for the batch step in hand (an upload, a batch's commit). */
const BATCH_STOP_MS = 5_000;

/** How long a stopping worker waits for its last reports to the shared limiter. */
const FLOW_SETTLE_MS = 2_000;

/** `deno task worker`. */
export async function runWorker({ config, clients, log, shutdown }: RunContext<{ redis: true; sql: true }>) {
  const signal = shutdown();
  const registry = createRegistry();
  processMetrics(registry);
  maybeServeMetrics(config, registry, signal, () => ready({ ...clients, log }));
  await startWorker({ config, ...clients, log, registry }, signal);
  return 0;
}
