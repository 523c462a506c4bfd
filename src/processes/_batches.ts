/**
 * The Batch API as a worker process runs it (issue 43): the intake that records batch runs, and the submitter and
 * poller loops, when some deployment of LLM_DEPLOYMENTS is marked `"batch": true`; nothing otherwise.
 */
import type { Sql } from "postgres";
import type { Registry } from "prom-client";
import type { RedisClient } from "../clients.ts";
import type { ReplicaAck } from "../redis/replica_ack.ts";
import type { Config } from "../config.ts";
import type { Logger } from "../log/logger.ts";
import type { Budgets } from "../budgets/budgets.ts";
import { passEvery } from "../batches/_pass_loop.ts";
import type { Prices } from "../llm/prices.ts";
import { defaultModel, deploymentSpecs } from "../llm/deployment_specs.ts";
import type { ServiceKeys } from "../runs/keys.ts";
import { createGroupCommitter } from "../runs/commit.ts";
import type { BatchIntake } from "../runs/run_deps.ts";
import { type BatchClient, createBatchClient } from "../batches/batch_client.ts";
import { createBatchIntake } from "../batches/batch_intake.ts";
import { batchMetrics } from "../batches/batch_metrics.ts";
import { createBatchOnline } from "../batches/batch_online.ts";
import { createBatchPoller, type PollerOptions } from "../batches/batch_poller.ts";
import { createBatchSubmitter, type SubmitterOptions } from "../batches/batch_submitter.ts";

/** The batch services of one worker process. */
export interface WorkerBatches {
  /** What the worker's run job records batch runs with. */
  intake: BatchIntake;
  /** The batch deployments, by name. */
  deployments: string[];
  /** Runs the submitter and the poller until `signal` aborts; each finishes its current batch first. */
  run(signal: AbortSignal): Promise<void>;
}

/** Timings a test may shorten (the defaults are the services' own). */
export type BatchTimings =
  & Pick<SubmitterOptions, "intervalMs" | "leaseMs">
  & Pick<PollerOptions, "pollMs" | "intervalMs">
  & {
    /** How often the budgets' holds of batch lines are swept (`Budgets.sweepHolds`); default 5 minutes. */
    sweepMs?: number;
    /** How old a hold must be for the sweep to look at it; default 10 minutes. */
    sweepAfterMs?: number;
  };

/**
 * The batch services over the configured batch deployments, and their metrics on `registry` when given;
 * undefined (and no metrics) when no deployment is marked `"batch": true`.
 */
export function buildBatches(
  { config, sql, redis, log, keys, prices, budgets, registry, ack }: {
    config: Config;
    sql: Sql;
    redis: RedisClient;
    /** REDIS_MIN_REPLICAS_ACK's runner: the online path's sends wait for the replicas. */
    ack?: ReplicaAck;
    log: Logger;
    keys: ServiceKeys;
    prices: Prices;
    budgets?: Budgets;
    registry?: Registry;
  },
  timings: BatchTimings = {},
): WorkerBatches | undefined {
  if (!config.LLM_DEPLOYMENTS) return undefined;
  const specs = deploymentSpecs(config);
  const intake = createBatchIntake({ sql }, {
    specs,
    defaultModel: defaultModel(config),
    maxRuns: config.BATCH_MAX_RUNS,
  });
  if (!intake) return undefined;
  const clients = new Map<string, BatchClient>(
    specs.filter((spec) => spec.batch && spec.name !== undefined).map((spec) => [
      spec.name!,
      createBatchClient({ apiKey: spec.apiKey, baseURL: spec.baseURL }),
    ]),
  );
  const metrics = registry && batchMetrics(registry, { sql }, { deployments: [...clients.keys()] });
  const submitter = createBatchSubmitter({ sql, clients, log }, {
    maxWaitMs: config.BATCH_MAX_WAIT_S * 1000,
    onSettled: metrics?.settled,
    intervalMs: timings.intervalMs,
    leaseMs: timings.leaseMs,
  });
  // Its own committer: batch lines commit beside the worker's runs, through the same commit and outbox.
  const poller = createBatchPoller({ sql, clients, log, committer: createGroupCommitter({ sql, log }) }, {
    onExpiry: config.BATCH_ON_EXPIRY,
    online: createBatchOnline({ redis, keys, ack }),
    prices,
    budgets,
    onSettled: metrics?.settled,
    pollMs: timings.pollMs,
    intervalMs: timings.intervalMs,
  });
  return {
    intake,
    deployments: [...clients.keys()],
    async run(signal) {
      // Holds whose lines ended without settling them (a worker killed between a hold and its run's recording, a
      // settlement that failed) are released, or charged at their line's recorded charge.
      const sweep = async () => {
        const settled = await budgets!.sweepHolds({ olderThanMs: timings.sweepAfterMs });
        if (settled > 0) log.info("budget_holds_swept", { holds: settled });
      };
      const sweeping = budgets
        ? passEvery(
          timings.sweepMs ?? 5 * 60_000,
          signal,
          () => sweep().catch((error) => log.warn("budget_hold_sweep_failed", { error })),
        )
        : undefined;
      await Promise.all([submitter.run(signal), poller.run(signal), sweeping]);
    },
  };
}
