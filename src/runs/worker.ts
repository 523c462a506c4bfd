import { JOB_ID } from "./shapes.ts";
import type { RedisClient } from "../clients.ts";
import type { Sql } from "postgres";
import { estimateTokens, estimateTokensOfLength, summaryPrompt } from "../llm/llm.ts";
import type { Models } from "../llm/models.ts";
import type { Logger } from "../log/logger.ts";
import type { ReplicaAck } from "../redis/replica_ack.ts";
import { createStreamWorker, type StreamWorker, type WorkerEvents } from "../queue/stream_worker.ts";
import { acceptedMsOf, laneId, type LaneNames, type StreamMessage } from "../queue/message.ts";
import { createTenantWeights, TENANT_WEIGHT } from "../tenants/tenant_weights.ts";
import { createGroupCommitter, failRun } from "./commit.ts";
import { runOfPayload } from "./run_payload.ts";
import type { SummaryJobDeps, SummaryJobOptions } from "./run_deps.ts";
import type { LaneKeys, ServiceKeys } from "./keys.ts";
import { createLaneRegistry } from "../queue/lanes.ts";
import { decideStart, markFailedHook, readStartDecision, recordExpiryOnAck } from "./job_status.ts";
import { notifyJob } from "./job_waiter.ts";
import { keepDrainingLegacyStream } from "./legacy_drain.ts";
import { createSummaryJob } from "./run_job.ts";
import { createAttemptLog, describeFailures } from "./attempt_log.ts";
import type { BudgetExhausted, Budgets } from "../budgets/budgets.ts";
import { announceLane } from "../queue/lanes.ts";
import { sleep } from "../async/timeout.ts";
import { createResultCache, type ResultCacheOptions } from "../cache/result_cache.ts";

/** The summary prompt's characters besides the document. */
const PROMPT_FRAME = summaryPrompt("").length;

/** Options for {@linkcode createSummaryWorker}. */
export interface SummaryWorkerOptions {
  /** The service's keys: a lane per tenant, each read stream by stream in its order. */
  keys: ServiceKeys;
  /** The most jobs of one tenant in flight across all workers (TENANT_MAX_IN_FLIGHT). */
  tenantMaxInFlight?: number;
  /** How often the lane registry's sweep finds lanes with work the workers were not told about; default 30 s. */
  laneSweepMs?: number;
  /** How long tenant weights are used before they are read again; default 10 s. */
  weightsTtlMs?: number;
  consumer: string;
  claimIdleMs: number;
  maxDeliveries: number;
  concurrency: number;
  job: SummaryJobOptions;
  /** The result cache's default TTL (RESULT_CACHE_TTL_S), prices and events; unset, only tasks with `cache_ttl_s` cache. */
  cache?: Omit<ResultCacheOptions, "defaultTtlS"> & { defaultTtlS?: number };
  blockMs?: number;
  graceMs?: number;
  heartbeatMs?: number;
  /** How long a job's status record is kept once its message is acknowledged; default `JOB_RECORD_TTL_S`. */
  recordTtlS?: number;
  events?: WorkerEvents;
}

/** The summary worker: the stream worker running the summary job. The caller closes it. */
export function createSummaryWorker(
  deps:
    & { redis: RedisClient; sql: Sql; models: Models; log: Logger; ack?: ReplicaAck }
    & Pick<SummaryJobDeps, "tasks" | "validators" | "budgets" | "prices" | "batches">,
  options: SummaryWorkerOptions,
): StreamWorker {
  const committer = createGroupCommitter({ sql: deps.sql, log: deps.log });
  // Every model attempt is recorded, in batches, off the commit path.
  const attempts = createAttemptLog({ sql: deps.sql, log: deps.log });
  const share = tokenShare(deps, options);
  const keys = options.keys;
  const blocks = deps.budgets ? budgetBlocks({ ...deps, budgets: deps.budgets }, keys, share.tenantOf) : undefined;
  // Always there: a task version's cache_ttl_s turns it on for its runs even when RESULT_CACHE_TTL_S is 0.
  const cache = createResultCache(deps, {
    ...options.cache,
    defaultTtlS: options.cache?.defaultTtlS ?? 0,
    keys: (tenant) => keys.cache(tenant),
  });
  const recordStatus = async (jobId: string, tenant: string) =>
    await deps.redis.hget(keys.lane(tenant).job(jobId), "status") ?? undefined;
  // A run with an expiry has its start decided once, in its record, before its first attempt goes out: a
  // redelivery knows it started. With REDIS_MIN_REPLICAS_ACK (`ack`), only once the replicas have the decision.
  const starts = {
    decide: (jobId: string, tenant: string, mode: "start" | "expire", expiresAtMs: number) =>
      decideStart(deps.redis, keys.lane(tenant).job(jobId), mode, expiresAtMs, deps.ack),
    read: (jobId: string, tenant: string) => readStartDecision(deps.redis, keys.lane(tenant).job(jobId)),
  };
  const job = createSummaryJob({
    ...deps,
    committer,
    attempts,
    cache,
    budgetExhausted: blocks?.exhausted,
    recordStatus,
    starts,
  }, {
    ...options.job,
    onAttempt: share.onAttempt,
  });
  const lanes = createLaneRegistry({ redis: deps.redis, log: deps.log }, {
    keys: keys.registry,
    lane: share.laneOf((tenant) => keys.lane(tenant)),
    sweepMs: options.laneSweepMs,
  });
  const worker = createStreamWorker({ redis: deps.redis, log: deps.log }, {
    lanes,
    laneMaxInFlight: options.tenantMaxInFlight,
    // Tenants share the provider by tokens and weight, not by job count.
    cost: share.cost,
    spent: share.spent,
    weights: share.weights,
    consumer: options.consumer,
    claimIdleMs: options.claimIdleMs,
    maxDeliveries: options.maxDeliveries,
    concurrency: options.concurrency,
    blockMs: options.blockMs,
    graceMs: options.graceMs,
    heartbeatMs: options.heartbeatMs,
    onDeadLetter: markFailedHook,
    expireOnAck: recordExpiryOnAck(options.recordTtlS),
    // Postgres decides first: a job done or cancelled meanwhile is acknowledged, never dead-lettered, and a
    // failed one can no longer be committed by a delivery still running elsewhere.
    beforeDeadLetter: async (message, reason) => {
      const { job_id: jobId, tenant } = message.fields;
      if (!jobId || !JOB_ID.test(jobId) || !tenant) return true;
      // Past MAX_DELIVERIES, the record of its attempts says what kept failing (a poison document, if the
      // provider served other jobs meanwhile).
      const how = reason.startsWith("exceeded") ? await describeFailures(deps.sql, jobId).catch(() => null) : null;
      const full = how ? `${reason}: ${how}` : reason;
      const job = { jobId, tenant, acceptedMs: acceptedMsOf(message) };
      return (await failRunOf(deps.sql, message.fields.payload, job, full)) === "failed" && full;
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
    // With a shared provider limit, jobs wait in the stream until a permit is near, not in this process: the
    // deployments say how many jobs of the recent average estimate may be read.
    gate: deps.models.capacity && (() => deps.models.capacity!(share.averageCost())),
    // A tenant whose budget is spent: its runs wait in its lane, which is not read until the budget fits again.
    skip: blocks?.skip,
    // A job read ahead makes its pre-check while it waits for its slot; one that failed is asked again at start.
    readAhead: job.prepare,
    onDeferred: blocks?.deferred,
    // A job read ahead and handed back at a stop: the other workers are told its lane has work.
    onHandedBack: async (_stream, message) => {
      const tenant = message.fields.tenant;
      if (tenant) {
        await announceLane(deps.redis, keys.registry, tenant).catch((error) =>
          deps.log.warn("lane_announce_failed", { tenant, error })
        );
      }
    },
  }, job);
  return {
    ...worker,
    async run(signal) {
      const stopBlocks = blocks?.start(signal);
      // Whatever an upgrade left in the stream of releases before lanes moves into the lanes, beside the first
      // reads and then every 30 s while the worker runs; the moved jobs are read from their lanes like any other.
      const drained = keepDrainingLegacyStream(deps, { keys, signal });
      await worker.run(signal);
      await drained;
      await stopBlocks;
    },
    get inFlight() {
      return worker.inFlight;
    },
    async close() {
      await worker.close();
      await lanes.close();
      await attempts.close();
    },
  };
}

/**
 * Decides the job of a message failed; a task run's failure notification is written with the decision. A
 * payload that cannot be read (the malformed job being dead-lettered) is decided failed as a summary job.
 */
function failRunOf(
  sql: Sql,
  payload: string | undefined,
  job: { jobId: string; tenant: string; acceptedMs?: number },
  reason: string,
) {
  let run;
  try {
    run = runOfPayload(payload ?? "");
  } catch {
    return failRun(sql, { ...job, task: "summarize", version: 1 }, reason, { summary: true });
  }
  return failRun(sql, { ...job, ...run }, reason, run);
}

/**
 * What the lanes are shared by: each job's estimated tokens (what the provider limiter reserves for it),
 * corrected to the tokens the provider reported once it is done, divided by its tenant's weight.
 */
function tokenShare(deps: { sql: Sql; log: Logger }, options: SummaryWorkerOptions) {
  const tenantWeights = createTenantWeights(deps, { ttlMs: options.weightsTtlMs });
  // Lane (its laneId) -> tenant, filled as the registry names lanes.
  const tenants = new Map<string, string>();
  // Job id -> tokens the provider reported for this delivery's attempts so far, and whether any did.
  const used = new Map<string, { tokens: number; reported: boolean }>();
  // Running average of the estimates of the jobs read, for the token gate.
  let average = 0;
  return {
    averageCost: () => average || estimateTokens(""),
    /** The tenant of a lane the registry named. */
    tenantOf: (lane: LaneNames) => tenants.get(laneId(lane)),
    laneOf(lane: (tenant: string) => LaneKeys) {
      return (tenant: string) => {
        const keys = lane(tenant);
        if (tenants.size >= 100_000) tenants.clear();
        tenants.set(laneId(keys), tenant);
        return keys;
      };
    },
    cost(message: StreamMessage): number {
      // From the payload's length, not its parse: the job parses it once, and the rest of the payload (the
      // address or URL, JSON's quotes) adds only a few tokens to the estimate.
      const estimate = estimateTokensOfLength(PROMPT_FRAME + (message.fields.payload ?? "").length);
      average = average === 0 ? estimate : average + 0.2 * (estimate - average);
      return estimate;
    },
    /** The tokens the delivery's calls used: none without a call, unknown (the estimate stands) without usage. */
    spent(message: StreamMessage): number | undefined {
      const jobId = message.fields.job_id ?? "";
      const entry = used.get(jobId);
      used.delete(jobId);
      if (!entry) return 0;
      return entry.reported ? entry.tokens : undefined;
    },
    onAttempt: ((report) => {
      const { prompt_tokens: prompt, completion_tokens: completion } = report.details ?? {};
      const reported = prompt !== undefined || completion !== undefined;
      const entry = used.get(report.job_id) ?? { tokens: 0, reported: false };
      // Bounded: entries are taken by `spent` when the delivery ends; only abandoned ones could pile up.
      if (used.size >= 100_000) used.clear();
      used.set(report.job_id, {
        tokens: entry.tokens + (prompt ?? 0) + (completion ?? 0),
        reported: entry.reported || reported,
      });
      options.job.onAttempt?.(report);
    }) satisfies SummaryJobOptions["onAttempt"],
    async weights(): Promise<(lane: LaneNames) => number> {
      const byTenant = await tenantWeights.current();
      return (lane) => byTenant.get(tenants.get(laneId(lane)) ?? "") ?? TENANT_WEIGHT.default;
    },
  };
}

/** How often a worker asks whether a blocked tenant's budget fits again. */
const BUDGET_RECHECK_MS = 1_000;
/** How long a blocked tenant's `waiting_until` mark lasts unless a worker renews it (GET's `waiting_for`). */
const BUDGET_WAITING_MARK_MS = 5_000;

/**
 * The tenants whose budgets are spent, as this worker knows them: their lanes are not read (their runs wait
 * there, spending no deliveries), and once a second the worker asks whether the refused worst case fits again
 * (the period ended, the budget was raised, reservations in flight settled); then it reads them again at once.
 * While a tenant is blocked, its budget hash carries `waiting_until`, which `GET /v1/runs/{id}` reads.
 */
function budgetBlocks(
  deps: { redis: RedisClient; log: Logger; budgets: Budgets },
  keys: ServiceKeys,
  tenantOf: (lane: LaneNames) => string | undefined,
) {
  const blocked = new Map<string, BudgetExhausted>();
  const mark = (tenant: string) =>
    deps.budgets.markWaiting(tenant, Date.now() + BUDGET_WAITING_MARK_MS)
      .catch((error) => deps.log.warn("budget_mark_failed", { tenant, error }));
  const wake = (tenant: string) =>
    announceLane(deps.redis, keys.registry, tenant).catch((error) =>
      deps.log.warn("lane_announce_failed", { tenant, error })
    );
  async function recheck(): Promise<void> {
    for (const [tenant, error] of blocked) {
      const fits = Date.now() >= error.untilMs || await deps.budgets.fitsAgain(error).catch((e) => {
        deps.log.warn("budget_recheck_failed", { tenant, error: e });
        return false;
      });
      if (fits) {
        blocked.delete(tenant);
        deps.log.info("budget_fits_again", { tenant });
        await deps.budgets.clearWaiting(tenant).catch(() => {});
        await wake(tenant);
      } else await mark(tenant);
    }
  }
  return {
    exhausted(error: BudgetExhausted) {
      const known = blocked.get(error.tenant);
      if (!known) mark(error.tenant);
      // The smallest worst case refused is what must fit again: a large run refused must not hold back the
      // tenant's smaller ones once they fit.
      if (!known || error.worst.tokens < known.worst.tokens) blocked.set(error.tenant, error);
    },
    skip(lane: LaneNames): boolean {
      if (blocked.size === 0) return false;
      const tenant = tenantOf(lane);
      return tenant !== undefined && blocked.has(tenant);
    },
    // The lane keeps its place among the lanes with work: this worker reads it again once the budget fits.
    async deferred(_stream: unknown, message: StreamMessage) {
      if (message.fields.tenant) await wake(message.fields.tenant);
    },
    async start(signal: AbortSignal): Promise<void> {
      while (!signal.aborted) {
        await sleep(BUDGET_RECHECK_MS, signal).catch(() => {});
        if (!signal.aborted && blocked.size > 0) await recheck();
      }
    },
  };
}
