/**
 * Flow control for one model provider, shared by every worker process
 * through one Redis hash: a paced rate limiter (requests and tokens per
 * minute), a shared pause on 429, and a circuit breaker. Every decision runs
 * in a Lua script on that one key, so it is atomic across processes and the
 * key can live on any Redis Cluster slot. Time is Redis's own (`TIME`), so
 * workers on hosts with different clocks agree.
 */
import type { RedisClient } from "../clients.ts";
import { createHash } from "node:crypto";
import { sleep } from "../async/timeout.ts";
import type { Completion, Usage } from "../llm/llm.ts";
import type { Logger } from "../log/logger.ts";
import { createBatcher } from "../async/batcher.ts";
import {
  type AcquireReply,
  type AcquireRequest,
  type AcquireSettings,
  liveConfigKey,
  runAcquire,
} from "./acquire_script.ts";
import { runSettle, type SettleOutcome, type SettleReply, type SettleSettings } from "./settle_script.ts";
import { readProviderState } from "./status_script.ts";
import { replyMemoKey } from "./reply_memo.ts";
import {
  type FailureKind,
  failureKindOf,
  headersOf,
  isProviderWide,
  reasonOf,
  retryAfterMs,
} from "../retry/classify.ts";
import { GateRefused } from "../retry/errors.ts";
import { parseRateLimitHeaders } from "./rate_limit_headers.ts";

/** Defaults, in one place. */
export const FLOW_DEFAULTS = {
  /**
   * Distinct jobs whose calls failed with no success between them, in ways no document causes (a connection
   * error, 502, 503, 504, an answer with Retry-After), that open the breaker; and the fewest distinct jobs whose
   * failures a document can cause (a 500, a timeout) that open it by the failing share below. From two failing
   * jobs on, the limiter lets one call through at a time. One job failing again and again is that job's failure,
   * not the provider's: it counts once.
   */
  failureThreshold: 3,
  /**
   * Failures a document can cause open the breaker only when at least this share of the calls over the last
   * `shareWindowMs` failed, among at least `minCalls` calls, from `failureThreshold` distinct jobs of at least
   * `minTenants` tenants, or from `loneTenantJobs` distinct jobs of one tenant...
   */
  failureShare: 0.5,
  shareWindowMs: 10_000,
  minCalls: 5,
  minTenants: 2,
  /** ...so three poison documents of one tenant are not an outage, and a queue of one tenant's jobs can still see one. */
  loneTenantJobs: 5,
  /**
   * While the limiter lets one call at a time through (a suspect or half-open provider), a job whose own
   * call just failed may take that call only after this long without another caller: the probe goes to
   * a job that has not just failed, when there is one.
   */
  suspectProbeDelayMs: 500,
  /**
   * Until the first answer tells the limits (nothing configured), calls start one at a time, this far apart at
   * least: a first call that hangs holds up the others for this long, not for its whole timeout.
   */
  learnStepMs: 250,
  /** How long a job whose failure came while the provider served others stays known as a bad document. */
  badJobTtlMs: 10 * 60_000,
  /** Failures by attribution are counted over windows of this length, for `provider status`. */
  recentWindowMs: 5 * 60_000,
  /** An open breaker's first probe goes out after this long (or LLM_BREAKER_COOLDOWN_S when shorter)... */
  firstProbeMs: 1_000,
  /** ...and a fresh job's failed probe multiplies the wait by this, up to LLM_BREAKER_COOLDOWN_S. */
  cooldownGrowth: 2,
  /**
   * How long a process's configured limits (LLM_RPM, LLM_TPM) count for everyone after it last said so: it says
   * so again every third of this while it asks for permits, and withdraws them when it stops. A process killed,
   * or restarted with another configuration, stops counting within this.
   */
  configTtlMs: 10_000,
  /** Permits are paced at this share of the limit, leaving room for clock and network jitter. */
  margin: 0.95,
  /**
   * The first request permit after this long without one takes two slots: the provider counts when calls arrive,
   * the limiter when they are granted, and that call may arrive late (a new connection) or follow the calls made
   * while the limits were unknown (they book no slot), which put limit + 1 calls in the provider's first second.
   */
  coldAfterMs: 1_000,
  /** How far ahead a caller may book a permit; beyond it, it waits without booking. */
  maxAheadMs: 1_000,
  /** The stream gate counts permits due within this horizon. */
  horizonMs: 1_000,
  /** The shortest shared pause on a 429, whatever its Retry-After says, so a zero cannot make a busy loop. */
  minPauseMs: 100,
  /**
   * The longest shared pause, whatever Retry-After or a reset header says: one bad header must not stop every
   * model call for days. A provider still limiting when it ends answers the next call with a 429, which pauses again.
   */
  maxPauseMs: 5 * 60_000,
  /** How long an idle provider's state is kept. */
  stateTtlMs: 7 * 24 * 3600 * 1000,
  /**
   * How long a flow script call's reply is kept for a resend of the same call (a reply lost with its connection;
   * see `reply_memo.ts`): a resend later than this, after so long an outage, applies again.
   */
  replyTtlMs: 60 * 60_000,
  /**
   * While no limit is in force (none configured, none learned from the headers), the breaker is closed, nothing
   * is paused and no call has failed since the last success, Redis says so with a permit, and the process may
   * then grant permits itself, without a round trip, for this long after that answer...
   */
  leaseMs: 200,
  /**
   * ...and at most this many. So a process starts at most this many calls, within at most `leaseMs`, after
   * another process opened the breaker, was paused by a 429 or learned a limit. Nothing is reserved by a lease:
   * there is nothing to give back when a process stops or dies. A failure this process sees, or a limit in an
   * answer's headers, ends its lease at once.
   */
  leasePermits: 256,
  /**
   * The most requests (or outcomes) one script call decides. Callers that ask while a call is in flight share
   * the next one, decided in order exactly as that many calls in a row would be: one round trip per batch.
   */
  maxBatch: 256,
} as const;

/** Breaker states: `closed` calls freely, `open` calls nothing, `half_open` lets one probe through. */
export type BreakerState = "closed" | "open" | "half_open";

/** Whom a failed call was charged to: the provider (the breaker, a pause) or the job (its attempt). */
export type Attribution = "provider" | "job";

/** What the flow control reports, for metrics and logs. */
export interface FlowEvents {
  granted?(waitMs: number, probe: boolean): void;
  /** A call failed, charged to `attribution`, for `reason` (`timeout`, `http_500`, `http_401`, ...). */
  failed?(attribution: Attribution, reason: string): void;
  /** A 429 by kind (`rate_limited` or `quota`). */
  limited?(kind: "rate_limited" | "quota"): void;
  tokens?(usage: Usage): void;
  breaker?(from: BreakerState, to: BreakerState, reason: string): void;
}

/** Options for {@linkcode createProviderFlow}. */
export interface ProviderFlowOptions {
  /** The Redis hash holding this provider's state; see {@linkcode providerStateKey}. */
  key: string;
  /** Configured requests per minute (LLM_RPM) for all workers together; headers may tighten it. */
  rpm?: number;
  /** Configured tokens per minute (LLM_TPM). */
  tpm?: number;
  /** LLM_BREAKER_COOLDOWN_S, in ms: the longest an open breaker waits before its next probe. */
  cooldownMs: number;
  /** How long a probe may hold the single slot before another caller may probe: a call's timeout plus slack. */
  probeLeaseMs: number;
  failureThreshold?: number;
  margin?: number;
  maxAheadMs?: number;
  random?: () => number;
  events?: FlowEvents;
  /** See `FLOW_DEFAULTS.configTtlMs`. */
  configTtlMs?: number;
  /** See `FLOW_DEFAULTS.firstProbeMs`. */
  firstProbeMs?: number;
  /**
   * Say this process's configured limits again from a timer when no acquire call does (a process's own flow; not
   * for a flow that only reads the status). Stopped by `withdraw`.
   */
  keepAlive?: boolean;
}

/** How a call that held a permit ended. */
export interface PermitOutcome {
  value?: Completion;
  error?: unknown;
  /** The caller gave up (shutdown): says nothing about the provider. */
  aborted?: boolean;
}

/** The right to make one model call now. */
export interface Permit {
  /** How long the caller waited for it, in ms (not charged to the job's deadline). */
  readonly waitedMs: number;
  /** Whether this call is the breaker's (or the limit learner's) single probe. */
  readonly probe: boolean;
  /**
   * Reports the call's outcome: settles the token reservation, learns from
   * the headers, and moves the pause and the breaker. A success or an abort
   * is reported in the background, in order with this process's other
   * outcomes (it can change nothing for the caller): its promise resolves at
   * once with false. A failure's resolves once it is applied.
   * @returns whether flow control took the failure on itself (a 429, an
   * exhausted quota, an outage): the job should wait and try again without
   * counting an attempt.
   */
  settle(outcome: PermitOutcome): Promise<boolean>;
}

/**
 * Why a try for a permit got none: `reason` is the script's (`breaker_open`, `half_open`, `paused`, `probing`,
 * `suspect`, `pacing`), `ms` how long until it is worth asking again, and `lost` whether a slot booked ahead was
 * taken back when it came (the breaker opened or a pause began meanwhile).
 */
export interface Refusal {
  ms: number;
  reason: string;
  lost: boolean;
}

/** Where a limit in force came from. */
export type LimitSource = "config" | "headers" | "none";

/** One limit as `provider status` shows it. */
export interface LimitStatus {
  limit: number | null;
  source: LimitSource;
  /** The strictest that a live process configures, this one included once it asks for permits (null: none). */
  configured: number | null;
  /** What the provider's headers last said, while it still says it (null: it does not). */
  learned: number | null;
}

/** The shared state, as `deno task provider status` shows it. */
export interface ProviderStatus {
  key: string;
  now: number;
  rpm: LimitStatus;
  tpm: LimitStatus;
  /** The processes whose configuration counts now, each until its entry expires (it refreshes it well before). */
  configured_by: { rpm: number | null; tpm: number | null; expires_at: number }[];
  /** When the provider's headers last gave a limit, and when a success without them ended the learned ones. */
  headers: { at: number | null; stopped_at: number | null };
  /** Whether the limits are still being learned (one call at a time until the first headers). */
  learning: boolean;
  remaining: { requests: number | null; tokens: number | null; headers_at: number | null };
  reset: { requests_at: number | null; tokens_at: number | null };
  /** When the next permit is free (epoch ms); now or earlier means at once. */
  next_permit_at: number;
  pause: { until: number | null; reason: string | null };
  /** Failed calls in the current window (`recentWindowMs`, since `since`), by whom they were charged to. */
  recent_failures: { provider: number; job: number; since: number | null };
  breaker: {
    state: BreakerState;
    /** Distinct jobs whose calls failed since the last success. */
    failures: number;
    /** Of those, the ones whose failures no document causes, and their distinct tenants. */
    wide_failures: number;
    tenants: number;
    /** The failing share of the calls over the last `FLOW_DEFAULTS.shareWindowMs` (known bad documents aside). */
    failing_share: number | null;
    reason: string | null;
    /** What opened it (a failed probe keeps the first cause). */
    cause: string | null;
    opened_at: number | null;
    probe_at: number | null;
    cooldown_ms: number;
  };
}

/** A running flow control for one provider. */
export interface ProviderFlow {
  /**
   * Waits until a call of `estimatedTokens` for job `jobId` may go out: the
   * breaker lets it, no pause is in force, and the paced limiter has a
   * permit. The job id tells one job's failures from the provider's.
   * @throws the signal's reason when it aborts while waiting.
   */
  acquire(estimatedTokens: number, signal?: AbortSignal, jobId?: string, tenant?: string): Promise<Permit>;
  /**
   * Whether a worker should take jobs now: `permits` that can be granted
   * within about a second (less what this process is already waiting for),
   * or else `waitMs` until it is worth asking again.
   */
  ready(): Promise<{ permits: number; waitMs: number }>;
  /**
   * One try for a permit, for a caller that may go elsewhere: a permit now (or booked within about a second and
   * slept for), or why there is none and when to ask again. Not counted as waiting meanwhile (its caller counts
   * it: `onBooked` says when a slot is booked, before the sleep until it comes, after which this flow's gate
   * leaves the slot out).
   * @throws the signal's reason when it aborts; `GateRefused` when the call can never fit the token limit.
   */
  tryAcquire(
    estimatedTokens: number,
    signal?: AbortSignal,
    jobId?: string,
    tenant?: string,
    onBooked?: () => void,
  ): Promise<Permit | Refusal>;
  /** The shared state, once this process's outcomes reported so far are applied. */
  status(): Promise<ProviderStatus>;
  /** Callers of this process waiting for a permit now. */
  readonly waiting: number;
  /** Permits this process may still grant itself without asking Redis: its lease's (0 without one). */
  readonly leased: number;
  /** Resolves once every outcome reported so far is applied (or failed to be): before a process exits. */
  settled(): Promise<void>;
  /** Withdraws this process's configured limits from the shared state: when it stops. */
  withdraw(): Promise<void>;
}

/** The Redis key of a provider's state: one per base URL, model and API key (the key is hashed). */
export function providerStateKey(
  prefix: string,
  { baseURL, model, apiKey }: { baseURL: string; model: string; apiKey: string },
): string {
  const id = createHash("sha256").update(JSON.stringify([baseURL, model, apiKey])).digest("hex").slice(0, 16);
  return `${prefix}:provider:{${id}}`;
}

/** A header's wait for the script, in whole ms; -1 when absent. A value of ages stays a finite integer for Lua. */
function durationArg(ms: number | undefined): number {
  return ms === undefined || Number.isNaN(ms) ? -1 : Math.round(Math.min(ms, Number.MAX_SAFE_INTEGER));
}

/**
 * A count from a header or the provider's usage, as the script's JSON needs it: a finite number (JSON has no
 * Infinity or NaN, and a string would not compare as a number in Lua), else undefined.
 */
function countArg(value: unknown): number | undefined {
  const n = typeof value === "string" ? Number(value) : value;
  return typeof n === "number" && Number.isFinite(n) ? Math.min(n, Number.MAX_SAFE_INTEGER) : undefined;
}

/** What one flow control's functions share. */
interface Flow {
  log: Logger;
  options: ProviderFlowOptions;
  random: () => number;
  events: FlowEvents;
  /** Callers of this process waiting for a permit. */
  waiting: number;
  /**
   * Of those, callers refused the single call because their own job just failed: they must not keep the
   * worker from reading a fresh job, which is the probe they are waiting for.
   */
  suspects: number;
  /** Asks the acquire script; requests made while one call is in flight share the next. */
  ask: (request: AcquireRequest) => Promise<AcquireReply>;
  /** Reports outcomes to the settle script, one batch at a time, in the order they were reported. */
  report: (outcome: SettleOutcome) => Promise<SettleReply>;
  /** The last outcome reported: once it is applied, all before it are (they are applied in order). */
  lastReport: Promise<unknown>;
  /** This process's lease of unpaced permits, when it has one (see `FLOW_DEFAULTS.leaseMs`). */
  lease: { until: number; left: number } | undefined;
  /** Failures this process reported that are not applied yet: no lease is taken meanwhile. */
  unappliedFailures: number;
}

/**
 * Creates the flow control for the provider whose state is `options.key`.
 * Cheap to create; all state lives in Redis.
 */
export function createProviderFlow(
  { redis, log }: { redis: RedisClient; log: Logger },
  options: ProviderFlowOptions,
): ProviderFlow {
  const threshold = options.failureThreshold ?? FLOW_DEFAULTS.failureThreshold;
  const margin = options.margin ?? FLOW_DEFAULTS.margin;
  const maxAheadMs = options.maxAheadMs ?? FLOW_DEFAULTS.maxAheadMs;
  const cfgRpm = options.rpm ?? 0;
  const cfgTpm = options.tpm ?? 0;
  // Each batch is one call with an id of its own, made before it is sent: a resend of it carries the same id, and
  // the script applies it once. One batch of each script is in flight at a time, so one memo each suffices.
  const owner = crypto.randomUUID();
  const configTtlMs = options.configTtlMs ?? FLOW_DEFAULTS.configTtlMs;
  const acquireSettings: AcquireSettings = {
    cfg_rpm: cfgRpm,
    cfg_tpm: cfgTpm,
    max_ahead_ms: maxAheadMs,
    lease_ms: options.probeLeaseMs,
    margin,
    horizon_ms: FLOW_DEFAULTS.horizonMs,
    suspect_delay_ms: FLOW_DEFAULTS.suspectProbeDelayMs,
    state_ttl_ms: FLOW_DEFAULTS.stateTtlMs,
    reply_ttl_ms: FLOW_DEFAULTS.replyTtlMs,
    learn_step_ms: FLOW_DEFAULTS.learnStepMs,
    bad_ttl_ms: FLOW_DEFAULTS.badJobTtlMs,
    cold_after_ms: FLOW_DEFAULTS.coldAfterMs,
    owner,
    cfg_ttl_ms: configTtlMs,
    announce: 0,
  };
  // When this process last said its configuration (performance.now(), once Redis answered); it says it again after
  // a third of its TTL, with whatever acquire call comes next, or from a timer (`keepAlive`) when none comes: a
  // worker whose callers all wait out a pause or an open breaker still configures the limit.
  let announcedAt = -Infinity;
  let keepAliveTimer: ReturnType<typeof setInterval> | undefined;
  const due = () => performance.now() - announcedAt >= configTtlMs / 3;
  const withConfig = async <T>(call: (settings: AcquireSettings) => Promise<T>): Promise<T> => {
    if (!due()) return await call(acquireSettings);
    const at = performance.now();
    const result = await call({ ...acquireSettings, announce: 1 });
    announcedAt = Math.max(announcedAt, at);
    if (options.keepAlive && keepAliveTimer === undefined) {
      const timer = setInterval(() => {
        if (due()) withConfig((settings) => runAcquire(redis, options.key, settings, [])).catch(() => {});
      }, configTtlMs / 3);
      Deno.unrefTimer(timer);
      keepAliveTimer = timer;
    }
    return result;
  };
  const settleSettings: SettleSettings = {
    threshold,
    cooldown_ms: Math.min(options.firstProbeMs ?? FLOW_DEFAULTS.firstProbeMs, options.cooldownMs),
    max_cooldown_ms: options.cooldownMs,
    growth: FLOW_DEFAULTS.cooldownGrowth,
    share: FLOW_DEFAULTS.failureShare,
    share_window_ms: FLOW_DEFAULTS.shareWindowMs,
    min_calls: FLOW_DEFAULTS.minCalls,
    min_tenants: FLOW_DEFAULTS.minTenants,
    lone_jobs: FLOW_DEFAULTS.loneTenantJobs,
    margin,
    cfg_tpm: cfgTpm,
    min_pause_ms: FLOW_DEFAULTS.minPauseMs,
    max_pause_ms: FLOW_DEFAULTS.maxPauseMs,
    window_ms: FLOW_DEFAULTS.recentWindowMs,
    bad_ttl_ms: FLOW_DEFAULTS.badJobTtlMs,
    reply_ttl_ms: FLOW_DEFAULTS.replyTtlMs,
  };
  const acquireMemo = replyMemoKey(options.key, owner, "acquire");
  const settleMemo = replyMemoKey(options.key, owner, "settle");
  const flow: Flow = {
    log,
    options,
    random: options.random ?? Math.random,
    events: options.events ?? {},
    waiting: 0,
    suspects: 0,
    ask: createBatcher(
      (requests) =>
        withConfig((settings) =>
          runAcquire(redis, options.key, settings, requests, { key: acquireMemo, callId: crypto.randomUUID() })
        ),
      { maxBatch: FLOW_DEFAULTS.maxBatch, maxInFlight: 1 },
    ),
    // One batch at a time: the outcomes reach Redis in the order this process reported them.
    report: createBatcher(
      (outcomes) =>
        runSettle(redis, options.key, settleSettings, outcomes, { key: settleMemo, callId: crypto.randomUUID() }),
      { maxBatch: FLOW_DEFAULTS.maxBatch, maxInFlight: 1 },
    ),
    lastReport: Promise.resolve(),
    lease: undefined,
    unappliedFailures: 0,
  };
  const settled = () => flow.lastReport.then(() => {}, () => {});
  return {
    get waiting() {
      return flow.waiting;
    },
    get leased() {
      return leased(flow) ? flow.lease!.left : 0;
    },
    acquire: (estimatedTokens, signal, jobId = "", tenant = "") =>
      acquire(flow, estimatedTokens, signal, jobId, tenantTag(tenant)),
    tryAcquire: (estimatedTokens, signal, jobId = "", tenant = "", onBooked = () => {}) => {
      signal?.throwIfAborted();
      return takeOnce(flow, estimatedTokens, signal, jobId, tenantTag(tenant), performance.now(), onBooked);
    },
    async ready() {
      if (leased(flow)) return { permits: Math.max(0, UNLIMITED - (flow.waiting - flow.suspects)), waitMs: 0 };
      // Once per read, never behind a batch of takes in flight: its own round trip. A peek writes nothing, so it
      // needs no memo: run twice, it answers twice.
      const [reply] = await withConfig((settings) =>
        runAcquire(redis, options.key, settings, [{ mode: "peek", est: 0, probe_id: "", job: "" }])
      );
      const [raw, ms] = reply!;
      const permits = Math.max(0, raw - (flow.waiting - flow.suspects));
      // Permits this process's own waiters will take are not there for new jobs: look again shortly.
      return { permits, waitMs: permits > 0 ? 0 : raw > 0 ? 50 : ms };
    },
    async status() {
      await settled();
      const { now, fields, configs } = await readProviderState(redis, options.key, liveConfigKey(options.key));
      // A process that asks for permits is bound by its own configuration, whatever its entry says now.
      const own = announcedAt === -Infinity ? undefined : { rpm: cfgRpm, tpm: cfgTpm };
      return statusOf(fields, configs, now, flow, own);
    },
    settled,
    async withdraw() {
      clearInterval(keepAliveTimer);
      keepAliveTimer = undefined;
      if (announcedAt === -Infinity) return; // it never said anything
      announcedAt = -Infinity;
      await runAcquire(redis, options.key, { ...acquireSettings, announce: -1 }, []);
    },
  };
}

function ask(
  flow: Flow,
  estimated: number,
  mode: AcquireRequest["mode"],
  probeId = "",
  jobId = "",
) {
  return flow.ask({ mode, est: estimated, probe_id: probeId, job: jobId });
}

/** What the acquire script's peek answers when nothing limits the calls. */
const UNLIMITED = 1_000_000;

/** Whether this process holds a lease of unpaced permits now (and still has one to grant). */
function leased(flow: Flow): boolean {
  const lease = flow.lease;
  if (lease && lease.left > 0 && performance.now() < lease.until) return true;
  flow.lease = undefined;
  return false;
}

/** Waits for a permit: see {@linkcode ProviderFlow.acquire}. */
async function acquire(
  flow: Flow,
  estimatedTokens: number,
  signal: AbortSignal | undefined,
  jobId: string,
  tenant: string,
): Promise<Permit> {
  signal?.throwIfAborted();
  const started = performance.now();
  // Counted as waiting until a slot is booked (a caller sleeping until its booked slot is not waiting for one).
  let counted = true;
  flow.waiting++;
  const booked = () => {
    if (counted) flow.waiting--;
    counted = false;
  };
  try {
    for (;;) {
      signal?.throwIfAborted();
      const got = await takeOnce(flow, estimatedTokens, signal, jobId, tenant, started, booked);
      if ("settle" in got) return got;
      if (!counted) flow.waiting++;
      counted = true;
      // Spread the callers a pause or an open breaker releases at the same instant.
      const suspect = got.reason === "suspect";
      if (suspect) flow.suspects++;
      try {
        await sleep(got.ms + flow.random() * (got.lost ? 20 : Math.min(100, got.ms * 0.1 + 10)), signal);
      } finally {
        if (suspect) flow.suspects--;
      }
    }
  } finally {
    if (counted) flow.waiting--;
  }
}

/**
 * A permit now (or booked within `maxAheadMs`, slept for), or why not and when to ask again: one ask of the
 * script. `onBooked` is told when a slot is booked (before sleeping until it comes).
 * @throws {GateRefused} when the call can never fit the token limit; the signal's reason when it aborts.
 */
async function takeOnce(
  flow: Flow,
  estimatedTokens: number,
  signal: AbortSignal | undefined,
  jobId: string,
  tenant: string,
  started: number,
  onBooked: () => void,
): Promise<Permit | Refusal> {
  if (leased(flow)) {
    // Unpaced, and said so less than `leaseMs` ago: granted here, without a round trip.
    flow.lease!.left--;
    flow.events.granted?.(0, false);
    return {
      waitedMs: 0,
      probe: false,
      settle: (outcome) => settle(flow, estimatedTokens, "", outcome, jobId, tenant),
    };
  }
  const id = crypto.randomUUID();
  const [code, ms, reason] = await ask(flow, estimatedTokens, "take", id, jobId);
  if (code === -1) {
    throw new GateRefused(
      `the call's ${estimatedTokens} estimated tokens exceed the provider's tokens-per-minute limit`,
    );
  }
  if (code <= 0) return { ms, reason, lost: false };
  const probe = code === 2;
  const probeId = probe ? id : "";
  if (reason === "unpaced" && flow.unappliedFailures === 0) {
    flow.lease = { until: performance.now() + FLOW_DEFAULTS.leaseMs, left: FLOW_DEFAULTS.leasePermits };
  }
  onBooked();
  try {
    if (ms > 0) await sleep(ms, signal);
  } catch (error) {
    if (probe) await release(flow, estimatedTokens, probeId, jobId);
    throw error;
  }
  // A slot booked ahead is checked again when it comes: the breaker may have opened, or a 429
  // paused everyone, while this caller slept. Then the slot is forfeit and the caller waits.
  if (ms > 0) {
    const [go, again, why] = await ask(flow, estimatedTokens, probe ? "confirm_probe" : "confirm");
    if (go !== 1) {
      if (probe) await release(flow, estimatedTokens, probeId, jobId);
      return { ms: again, reason: why, lost: true };
    }
  }
  const waitedMs = performance.now() - started;
  flow.events.granted?.(waitedMs, probe);
  return {
    waitedMs,
    probe,
    settle: (outcome) => settle(flow, estimatedTokens, probeId, outcome, jobId, tenant),
  };
}

/** Gives a probe's slot back at once (its call never went out), and waits until that is applied. */
async function release(flow: Flow, estimated: number, probeId: string, jobId: string): Promise<void> {
  await settle(flow, estimated, probeId, { aborted: true }, jobId);
  await flow.lastReport.catch(() => {});
}

/** Reports a call's outcome: see {@linkcode Permit.settle}. */
function settle(
  flow: Flow,
  estimated: number,
  probeId: string,
  outcome: PermitOutcome,
  jobId = "",
  tenant = "",
): Promise<boolean> {
  const { events } = flow;
  const kind: FailureKind | "ok" | "aborted" = outcome.aborted
    ? "aborted"
    : outcome.error === undefined
    ? "ok"
    : failureKindOf(outcome.error);
  const headers = outcome.value?.headers ?? headersOf(outcome.error);
  const h = headers ? parseRateLimitHeaders(headers) : {};
  const usage = outcome.value?.usage;
  if (usage) events.tokens?.(usage);
  if (kind === "rate_limited" || kind === "quota") events.limited?.(kind);
  // A failure may open the breaker or pause everyone, and a limit in the headers paces everyone: this process
  // stops granting permits itself at once, and takes no lease until a failure's report is applied.
  const failure = kind !== "ok" && kind !== "aborted";
  if (failure || h.limitRequests !== undefined || h.limitTokens !== undefined) flow.lease = undefined;
  const reported = flow.report({
    kind,
    est: estimated,
    // A call the provider refused or never got costs no tokens; a timed-out one may have run, so it keeps them.
    actual: countArg(usage?.total_tokens) ??
      (kind === "ok" || (kind === "provider" && reasonOf(outcome.error) === "timeout") ? -1 : 0),
    probe_id: probeId,
    retry_after_ms: outcome.error === undefined ? -1 : durationArg(retryAfterMs(outcome.error)),
    limit_req: countArg(h.limitRequests) ?? -1,
    limit_tok: countArg(h.limitTokens) ?? -1,
    remaining_req: countArg(h.remainingRequests) ?? -1,
    remaining_tok: countArg(h.remainingTokens) ?? -1,
    reset_req_ms: durationArg(h.resetRequestsMs),
    reset_tok_ms: durationArg(h.resetTokensMs),
    job: jobId,
    wide: kind === "provider" && isProviderWide(outcome.error) ? 1 : 0,
    tenant,
    // An answer with headers but no limits among them: the provider no longer reports its limits.
    unreported: kind === "ok" && headers && h.limitRequests === undefined && h.limitTokens === undefined ? 1 : 0,
  }).then((reply) => applied(flow, outcome, reply));
  flow.lastReport = reported;
  if (failure) {
    flow.unappliedFailures++;
    reported.then(() => flow.unappliedFailures--, () => flow.unappliedFailures--);
  }
  // Only a failure can be absorbed: the caller of a success or an abort does not wait for the round trip. A
  // report that fails is lost, as before (the caller ignored it): the reservation stays booked, and the next
  // success closes what this one would have.
  if (kind === "ok" || kind === "aborted") {
    reported.catch(() => {});
    return Promise.resolve(false);
  }
  return reported;
}

/** What an applied outcome changed, told to the events and the log. @returns whether it was absorbed. */
function applied(
  { options, events, log }: Flow,
  outcome: PermitOutcome,
  [absorbed, from, to, reason, askedMs, pauseReason, attribution]: SettleReply,
): boolean {
  if (attribution) events.failed?.(attribution, reasonOf(outcome.error));
  if (askedMs > 0) {
    log.warn("provider_pause_capped", { reason: pauseReason, asked_ms: askedMs, applied_ms: FLOW_DEFAULTS.maxPauseMs });
  }
  if (from !== to) {
    events.breaker?.(from, to, reason);
    if (to === "open") {
      // Loud: nothing will be called until a probe succeeds, and an exhausted quota needs a person.
      const event = { insufficient_quota: "provider_quota_exhausted", unauthorized: "provider_unauthorized" }[
        reason as "insufficient_quota" | "unauthorized"
      ] ?? "provider_breaker_opened";
      log.error(event, { reason, cooldown_s: options.cooldownMs / 1000, error: outcome.error });
    } else if (to === "closed") log.info("provider_breaker_closed", { from });
  }
  return absorbed === 1;
}

/** A tenant as the breaker counts it: a short hash, so no tenant id needs quoting in the script's lists. */
function tenantTag(tenant: string): string {
  if (tenant === "") return "";
  let h = 0x811c9dc5; // FNV-1a, 32 bits
  for (let i = 0; i < tenant.length; i++) h = Math.imul(h ^ tenant.charCodeAt(i), 0x01000193);
  return (h >>> 0).toString(36);
}

/** The state hash's `fields` and the live `configs`, read at Redis time `now`, as `provider status` shows them. */
function statusOf(
  f: Map<string, string>,
  configs: Map<string, string>,
  now: number,
  flow: Flow,
  own?: { rpm: number; tpm: number },
): ProviderStatus {
  const num = (name: string) => (f.has(name) && f.get(name) !== "" ? Number(f.get(name)) : null);
  const configuredBy = [...configs.values()].flatMap((value) => {
    const [rpm, tpm, at] = value.split(" ").map(Number);
    return at! > now ? [{ rpm: rpm! > 0 ? rpm! : null, tpm: tpm! > 0 ? tpm! : null, expires_at: at! }] : [];
  });
  const strictest = (name: "rpm" | "tpm") =>
    configuredBy.reduce(
      (min, c) => (c[name] !== null && (min === 0 || c[name]! < min) ? c[name]! : min),
      own?.[name] ?? 0,
    );
  const rpm = limitOf(strictest("rpm"), num("hdr_rpm"));
  const tpm = limitOf(strictest("tpm"), num("hdr_tpm"));
  let state = (f.get("state") ?? "closed") as BreakerState;
  const openUntil = num("open_until");
  if (state === "open" && openUntil !== null && now >= openUntil) state = "half_open";
  const pauseUntil = num("pause_until");
  const since = num("recent_at");
  const recent = since !== null && now - since <= FLOW_DEFAULTS.recentWindowMs;
  const count = (name: string) => (f.get(name) ?? "").split(",").filter((id) => id !== "").length;
  return {
    key: flow.options.key,
    now,
    rpm,
    tpm,
    configured_by: configuredBy,
    headers: { at: num("hdr_at"), stopped_at: num("hdr_gone_at") },
    learning: rpm.limit === null && tpm.limit === null && f.get("learned") !== "1",
    remaining: { requests: num("hdr_rem_req"), tokens: num("hdr_rem_tok"), headers_at: num("hdr_at") },
    reset: { requests_at: num("hdr_reset_req_at"), tokens_at: num("hdr_reset_tok_at") },
    next_permit_at: Math.max(now, rpm.limit ? num("tat_req") ?? 0 : 0, tpm.limit ? num("tat_tok") ?? 0 : 0),
    recent_failures: recent
      ? { provider: num("recent_provider") ?? 0, job: num("recent_job") ?? 0, since }
      : { provider: 0, job: 0, since: null },
    pause: pauseUntil !== null && pauseUntil > now
      ? { until: pauseUntil, reason: f.get("pause_reason") ?? null }
      : { until: null, reason: null },
    breaker: {
      state,
      failures: num("failures") ?? 0,
      wide_failures: count("wide_jobs"),
      tenants: count("fail_tenants"),
      failing_share: failingShare(f, now),
      reason: f.get("opened_reason") || null,
      cause: state === "closed" ? null : f.get("open_cause") || null,
      opened_at: state === "closed" ? null : num("opened_at"),
      probe_at: state === "closed" ? null : openUntil,
      cooldown_ms: num("cooldown_ms") ??
        Math.min(flow.options.firstProbeMs ?? FLOW_DEFAULTS.firstProbeMs, flow.options.cooldownMs),
    },
  };
}

/** The failing share over the sliding window, as the settle script reckons it; null without calls in it. */
function failingShare(f: Map<string, string>, now: number): number | null {
  const n = (name: string) => Number(f.get(name) || 0);
  const windowMs = FLOW_DEFAULTS.shareWindowMs;
  const at = n("w_at");
  if (now - at >= 2 * windowMs) return null;
  let [calls, fails, prevCalls, prevFails] = [n("w_calls"), n("w_fails"), n("w_pcalls"), n("w_pfails")];
  let start = at;
  if (now - at >= windowMs) [start, prevCalls, prevFails, calls, fails] = [at + windowMs, calls, fails, 0, 0];
  const k = 1 - (now - start) / windowMs;
  const all = calls + prevCalls * k;
  return all > 0 ? Math.round(((fails + prevFails * k) / all) * 100) / 100 : null;
}

/** A limit in force: the configured one, or the learned one when it is lower or nothing is configured. */
function limitOf(configured: number, learned: number | null): LimitStatus {
  const c = configured > 0 ? configured : null;
  const l = learned !== null && learned > 0 ? learned : null;
  if (c !== null && (l === null || c <= l)) return { limit: c, source: "config", configured: c, learned: l };
  if (l !== null) return { limit: l, source: "headers", configured: c, learned: l };
  return { limit: null, source: "none", configured: c, learned: l };
}
