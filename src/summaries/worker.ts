import { JOB_ID } from "./schemas.ts";
import type { RedisClient } from "../clients.ts";
import type { Sql } from "postgres";
import type { LLM } from "../llm/llm.ts";
import type { ProviderFlow } from "../provider/flow_control.ts";
import type { Logger } from "../log/logger.ts";
import { createStreamWorker, type StreamWorker, type WorkerEvents } from "../queue/stream_worker.ts";
import { createGroupCommitter, failJob } from "./commit.ts";
import type { JobKeys, ServiceKeys } from "./keys.ts";
import { createLaneRegistry } from "../queue/lanes.ts";
import { markFailedHook } from "./job_status.ts";
import { notifyJob } from "./job_waiter.ts";
import { createSummaryJob, type SummaryJobOptions } from "./summary_job.ts";
import { createAttemptLog, describeFailures } from "./attempt_log.ts";

/** Options for {@linkcode createSummaryWorker}. */
export interface SummaryWorkerOptions {
  /** The service's keys (a lane per tenant, and the old single stream until it is empty), or one stream. */
  keys: ServiceKeys | JobKeys;
  /** The most jobs of one tenant in flight across all workers (TENANT_MAX_IN_FLIGHT). */
  tenantMaxInFlight?: number;
  /** How often the lane registry's sweep finds lanes with work the workers were not told about; default 30 s. */
  laneSweepMs?: number;
  consumer: string;
  claimIdleMs: number;
  maxDeliveries: number;
  concurrency: number;
  job: SummaryJobOptions;
  blockMs?: number;
  graceMs?: number;
  heartbeatMs?: number;
  events?: WorkerEvents;
}

/** The summary worker: the stream worker running the summary job. The caller closes it. */
export function createSummaryWorker(
  deps: { redis: RedisClient; sql: Sql; llm: LLM; log: Logger; flow?: ProviderFlow },
  options: SummaryWorkerOptions,
): StreamWorker {
  const committer = createGroupCommitter({ sql: deps.sql, log: deps.log });
  // Every model attempt is recorded, in batches, off the commit path.
  const attempts = createAttemptLog({ sql: deps.sql, log: deps.log });
  const job = createSummaryJob({ ...deps, committer, attempts }, options.job);
  const keys = options.keys;
  const lanes = "lane" in keys
    ? createLaneRegistry({ redis: deps.redis, log: deps.log }, {
      keys: keys.registry,
      lane: (tenant) => keys.lane(tenant),
      extra: [keys.legacy],
      sweepMs: options.laneSweepMs,
    })
    : undefined;
  const one = "lane" in keys ? keys.legacy : keys;
  const worker = createStreamWorker({ redis: deps.redis, log: deps.log }, {
    stream: one.stream,
    dead: one.dead,
    group: one.group,
    lanes,
    laneMaxInFlight: options.tenantMaxInFlight,
    consumer: options.consumer,
    claimIdleMs: options.claimIdleMs,
    maxDeliveries: options.maxDeliveries,
    concurrency: options.concurrency,
    blockMs: options.blockMs,
    graceMs: options.graceMs,
    heartbeatMs: options.heartbeatMs,
    onDeadLetter: markFailedHook,
    // Postgres decides first: a job done or cancelled meanwhile is acknowledged, never dead-lettered, and a
    // failed one can no longer be committed by a delivery still running elsewhere.
    beforeDeadLetter: async (message, reason) => {
      const { job_id: jobId, tenant } = message.fields;
      if (!jobId || !JOB_ID.test(jobId) || !tenant) return true;
      // Past MAX_DELIVERIES, the record of its attempts says what kept failing (a poison document, if the
      // provider served other jobs meanwhile).
      const how = reason.startsWith("exceeded") ? await describeFailures(deps.sql, jobId).catch(() => null) : null;
      const full = how ? `${reason}: ${how}` : reason;
      return (await failJob(deps.sql, jobId, tenant, full)) === "failed" && full;
    },
    events: {
      ...options.events,
      deadLettered(message, reason) {
        options.events?.deadLettered?.(message, reason);
        // A failed job is finished: wake requests waiting for it (a hint; they read the status themselves).
        const jobId = message.fields.job_id;
        if (jobId) {
          notifyJob(deps.sql, jobId).catch((error) => deps.log.warn("job_notify_failed", { job_id: jobId, error }));
        }
      },
    },
    // With a shared provider limit, jobs wait in the stream until a permit is near, not in this process.
    gate: deps.flow?.ready,
  }, job);
  return {
    ...worker,
    get inFlight() {
      return worker.inFlight;
    },
    async close() {
      await worker.close();
      await lanes?.close();
      await attempts.close();
    },
  };
}
