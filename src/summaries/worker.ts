import type { RedisClient } from "../clients.ts";
import type { Sql } from "postgres";
import type { LLM } from "../llm/llm.ts";
import type { ProviderFlow } from "../provider/flow_control.ts";
import type { Logger } from "../log/logger.ts";
import { createStreamWorker, type StreamWorker, type WorkerEvents } from "../queue/stream_worker.ts";
import { createGroupCommitter } from "./commit.ts";
import type { JobKeys } from "./keys.ts";
import { markFailedHook } from "./job_status.ts";
import { createSummaryJob, type SummaryJobOptions } from "./summary_job.ts";

/** Options for {@linkcode createSummaryWorker}. */
export interface SummaryWorkerOptions {
  keys: JobKeys;
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
  const job = createSummaryJob({ ...deps, committer }, options.job);
  return createStreamWorker({ redis: deps.redis, log: deps.log }, {
    stream: options.keys.stream,
    dead: options.keys.dead,
    group: options.keys.group,
    consumer: options.consumer,
    claimIdleMs: options.claimIdleMs,
    maxDeliveries: options.maxDeliveries,
    concurrency: options.concurrency,
    blockMs: options.blockMs,
    graceMs: options.graceMs,
    heartbeatMs: options.heartbeatMs,
    onDeadLetter: markFailedHook(options.keys),
    events: options.events,
    // With a shared provider limit, jobs wait in the stream until a permit is near, not in this process.
    gate: deps.flow?.ready,
  }, job);
}
