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
import { defineScript } from "../redis/script.ts";
import { fieldsToObject } from "../queue/message.ts";
import { type FailureKind, failureKindOf, headersOf, reasonOf, retryAfterMs } from "../retry/classify.ts";
import { GateRefused } from "../retry/errors.ts";
import { parseRateLimitHeaders } from "./rate_limit_headers.ts";

/** Defaults, in one place. */
export const FLOW_DEFAULTS = {
  /**
   * Distinct jobs whose calls failed (timeouts, connection errors, 5xx) with no success between them that
   * open the breaker. From two on, the limiter lets one call through at a time. One job failing again and
   * again is that job's failure, not the provider's: it counts once.
   */
  failureThreshold: 3,
  /**
   * While the limiter lets one call at a time through (a suspect or half-open provider), a job whose own
   * call just failed may take that call only after this long without another caller: the probe goes to
   * a job that has not just failed, when there is one.
   */
  suspectProbeDelayMs: 500,
  /** How long a job whose failure came while the provider served others stays known as a bad document. */
  badJobTtlMs: 10 * 60_000,
  /** Failures by attribution are counted over windows of this length, for `provider status`. */
  recentWindowMs: 5 * 60_000,
  /** A failed probe multiplies the cooldown by this... */
  cooldownGrowth: 1.5,
  /** ...up to this multiple of the configured cooldown, so a recovered provider is found within one period. */
  maxCooldownFactor: 2,
  /** Permits are paced at this share of the limit, leaving room for clock and network jitter. */
  margin: 0.97,
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
  /** LLM_BREAKER_COOLDOWN_S, in ms: how long an open breaker waits before its probe. */
  cooldownMs: number;
  /** How long a probe may hold the single slot before another caller may probe: a call's timeout plus slack. */
  probeLeaseMs: number;
  failureThreshold?: number;
  margin?: number;
  maxAheadMs?: number;
  random?: () => number;
  events?: FlowEvents;
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
   * the headers, and moves the pause and the breaker.
   * @returns whether flow control took the failure on itself (a 429, an
   * exhausted quota, an outage): the job should wait and try again without
   * counting an attempt.
   */
  settle(outcome: PermitOutcome): Promise<boolean>;
}

/** Where a limit in force came from. */
export type LimitSource = "config" | "headers" | "none";

/** The shared state, as `deno task provider status` shows it. */
export interface ProviderStatus {
  key: string;
  now: number;
  rpm: { limit: number | null; source: LimitSource; configured: number | null; learned: number | null };
  tpm: { limit: number | null; source: LimitSource; configured: number | null; learned: number | null };
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
    reason: string | null;
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
  acquire(estimatedTokens: number, signal?: AbortSignal, jobId?: string): Promise<Permit>;
  /**
   * Whether a worker should take jobs now: `permits` that can be granted
   * within about a second (less what this process is already waiting for),
   * or else `waitMs` until it is worth asking again.
   */
  ready(): Promise<{ permits: number; waitMs: number }>;
  status(): Promise<ProviderStatus>;
  /** Callers of this process waiting for a permit now. */
  readonly waiting: number;
}

/** The Redis key of a provider's state: one per base URL, model and API key (the key is hashed). */
export function providerStateKey(
  prefix: string,
  { baseURL, model, apiKey }: { baseURL: string; model: string; apiKey: string },
): string {
  const id = createHash("sha256").update(JSON.stringify([baseURL, model, apiKey])).digest("hex").slice(0, 16);
  return `${prefix}:provider:{${id}}`;
}

const PRELUDE = `
local key = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function n(v) return tonumber(v) or 0 end
local function lower(a, b) if a > 0 and b > 0 then return math.min(a, b) end return math.max(a, b) end
-- Lists of job ids, comma-separated.
local function has(list, id) return id ~= '' and string.find(',' .. (list or '') .. ',', ',' .. id .. ',', 1, true) ~= nil end
`;

// ARGV: cfg_rpm, cfg_tpm, estimated tokens, max ahead ms, probe lease ms, margin, mode, horizon ms, probe id,
// job id ('' = unknown), suspect probe delay ms.
// Returns {code, ms, detail}. Mode take: code 1 = permit booked ms from now, 2 = probe permit (lease held by the
// probe id), 0 = ask again in ms, -1 = this call can never fit the token limit. Mode peek: code = permits within
// the horizon, ms = wait before asking again. Mode confirm / confirm_probe: a booked slot has come; code 1 = go,
// 0 = the breaker or a pause stopped it meanwhile (ask again in ms).
const ACQUIRE = defineScript(
  PRELUDE + `
local cfg_rpm, cfg_tpm, est = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local max_ahead, lease, margin = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local mode, horizon, probe_id, job, suspect_delay = ARGV[7], tonumber(ARGV[8]), ARGV[9], ARGV[10], tonumber(ARGV[11])
local peek, confirm = mode == 'peek', mode == 'confirm' or mode == 'confirm_probe'
local h = redis.call('HMGET', key, 'state', 'open_until', 'probe_until', 'pause_until', 'tat_req', 'tat_tok',
  'hdr_rpm', 'hdr_tpm', 'learned', 'failures', 'fail_jobs', 'suspect_at', 'bad_jobs')
local state = h[1] or 'closed'
local open_until, probe_until, pause_until = n(h[2]), n(h[3]), n(h[4])
local tat_req, tat_tok = n(h[5]), n(h[6])
local rpm, tpm = lower(cfg_rpm, n(h[7])), lower(cfg_tpm, n(h[8]))
if state == 'open' then
  if now < open_until then return {0, open_until - now, 'breaker_open'} end
  state = 'half_open'
  if not peek then redis.call('HSET', key, 'state', 'half_open') end
end
if pause_until > now then return {0, pause_until - now, 'paused'} end
if mode == 'confirm_probe' then return {1, 0, 'probe'} end
-- One call at a time while probing a suspect (two jobs failed in a row) or half-open provider, or while the
-- limits are unknown. That call goes to a job that has not just failed, unless none asked for a while.
local suspect = state == 'half_open' or n(h[10]) >= 2
local single = suspect or (rpm == 0 and tpm == 0 and h[9] ~= '1')
if single and probe_until > now then return {0, math.min(probe_until - now, 100), 'probing'} end
local bad = job ~= '' and string.find(',' .. (h[13] or '') .. ',', ',' .. job .. '@', 1, true) ~= nil
if suspect and not peek and mode ~= 'confirm' and (has(h[11], job) or bad) then
  local since = n(h[12])
  if state == 'half_open' then since = math.max(since, open_until) end
  if now - since < suspect_delay then return {0, since + suspect_delay - now, 'suspect'} end
end
if confirm then
  if single then return {0, 0, 'probing'} end
  return {1, 0, 'permit'}
end
local req_iv, tok_iv = 0, 0
if rpm > 0 then req_iv = 60000 / (rpm * margin) end
if tpm > 0 then tok_iv = 60000 / (tpm * margin) end
local start = now
if req_iv > 0 and tat_req > start then start = tat_req end
if tok_iv > 0 and tat_tok > start then start = tat_tok end
local wait = start - now
if tpm > 0 and est > tpm then return {-1, 0, 'too_large'} end
if peek then
  if single then return {1, 0, 'probe'} end
  if wait > horizon then return {0, math.ceil(wait - horizon), 'pacing'} end
  if req_iv == 0 then return {1000000, 0, 'unlimited'} end
  return {math.floor((horizon - wait) / req_iv) + 1, 0, 'pacing'}
end
if wait > max_ahead then return {0, math.ceil(wait - max_ahead), 'pacing'} end
-- Book the slot: the next caller's earliest start moves one interval (and this call's tokens) later.
if req_iv > 0 then tat_req = math.max(now, tat_req) + req_iv end
if tok_iv > 0 then tat_tok = math.max(now, tat_tok) + est * tok_iv end
redis.call('HSET', key, 'tat_req', tat_req, 'tat_tok', tat_tok, 'cfg_rpm', cfg_rpm, 'cfg_tpm', cfg_tpm)
redis.call('PEXPIRE', key, ${FLOW_DEFAULTS.stateTtlMs})
if single then
  redis.call('HSET', key, 'probe_until', now + lease, 'probe_id', probe_id)
  return {2, math.ceil(wait), 'probe'}
end
return {1, math.ceil(wait), 'permit'}
`,
);

// ARGV: kind, estimated, actual tokens, probe id ('' = not a probe), retry-after ms, limit req, limit tok,
// remaining req, remaining tok, reset req ms, reset tok ms (-1 = absent), threshold, base cooldown, max cooldown,
// growth, margin, cfg_tpm, min pause ms, max pause ms, job id ('' = unknown), recent window ms, bad job TTL ms.
// Returns {absorbed, state before, state after, reason, asked ms, pause reason}: asked ms is the pause the headers
// asked for when it was cut to max pause ms, else 0.
const SETTLE = defineScript(
  PRELUDE + `
local kind = ARGV[1]
local est, actual, probe_id, retry_after = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5])
local lim_req, lim_tok, rem_req, rem_tok = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local reset_req, reset_tok = tonumber(ARGV[10]), tonumber(ARGV[11])
local threshold, base, maxc, growth = tonumber(ARGV[12]), tonumber(ARGV[13]), tonumber(ARGV[14]), tonumber(ARGV[15])
local margin, cfg_tpm, min_pause, max_pause = tonumber(ARGV[16]), tonumber(ARGV[17]), tonumber(ARGV[18]),
  tonumber(ARGV[19])
local job, window, bad_ttl = ARGV[20], tonumber(ARGV[21]), tonumber(ARGV[22])
local h = redis.call('HMGET', key, 'state', 'failures', 'cooldown_ms', 'tat_tok', 'hdr_tpm', 'pause_until', 'open_until',
  'probe_id', 'fail_jobs', 'recent_at', 'recent_provider', 'recent_job', 'bad_jobs', 'opened_reason')
-- Only the current probe speaks for the provider while the breaker is open or half-open: a call that started
-- before it opened, or a probe whose lease ran out and was replaced, must not move it.
local probe = probe_id ~= '' and h[8] == probe_id
local state = h[1] or 'closed'
if state == 'open' and now >= n(h[7]) then state = 'half_open' end
local before, failures, cooldown = state, n(h[2]), n(h[3])
if cooldown <= 0 then cooldown = base end
local f = {}
local function set(k, v) f[#f + 1] = k; f[#f + 1] = v end
local reason = ''
-- Learn the limits. A provider that answers without the headers is not paced by them.
local heard = lim_req >= 0 or lim_tok >= 0
if lim_req >= 0 then set('hdr_rpm', lim_req) end
if lim_tok >= 0 then set('hdr_tpm', lim_tok) end
if rem_req >= 0 then set('hdr_rem_req', rem_req) end
if rem_tok >= 0 then set('hdr_rem_tok', rem_tok) end
if reset_req >= 0 then set('hdr_reset_req_at', now + reset_req) end
if reset_tok >= 0 then set('hdr_reset_tok_at', now + reset_tok) end
if heard then set('hdr_at', now) end
if heard or kind == 'ok' or kind == 'request' or kind == 'rate_limited' then set('learned', '1') end
-- Settle the token reservation against what the provider counted.
local tpm = n(h[5])
if lim_tok >= 0 then tpm = lim_tok end
tpm = lower(cfg_tpm, tpm)
if actual >= 0 and tpm > 0 then
  set('tat_tok', math.max(n(h[4]), now) + (actual - est) * 60000 / (tpm * margin))
end
-- A budget the headers say is spent pauses everyone until enough of it is back. The reset header is the
-- time until the whole budget is back, so one unit returns every reset / (limit - remaining).
local pause_to, why = 0, ''
local function refill(limit, remaining, reset, need)
  if reset <= 0 then return 0 end
  if limit <= remaining then return math.min(reset, 1000) end
  return math.min(reset, (need - remaining) * reset / (limit - remaining))
end
if rem_req == 0 then pause_to, why = now + refill(lim_req, 0, reset_req, 1), 'requests_exhausted' end
if rem_tok >= 0 and rem_tok < est then
  local p = now + refill(lim_tok, rem_tok, reset_tok, est)
  if p > pause_to then pause_to, why = p, 'tokens_exhausted' end
end
local absorbed = 0
local function open(r)
  if before == 'half_open' then cooldown = math.min(cooldown * growth, maxc) else cooldown = base end
  state, reason = 'open', r
  set('state', 'open'); set('open_until', now + cooldown); set('cooldown_ms', cooldown)
  set('opened_reason', r); set('opened_at', now)
end
local speaks = probe or before == 'closed'
-- Jobs whose calls failed since the last success: the provider is failing only when several distinct jobs
-- are (a job that fails again and again counts once). A job that failed is a suspect for the next probe.
local fail_jobs = h[9] or ''
-- Known bad documents, as 'job@ms' entries (at most 32, none older than bad_ttl): jobs whose calls failed
-- while the provider served another job. Their failures are theirs alone, even as a probe.
local bad_jobs = h[13] or ''
local function bad(id) return id ~= '' and string.find(',' .. bad_jobs .. ',', ',' .. id .. '@', 1, true) ~= nil end
local function keep_bad(add, drop)
  local kept = {}
  for entry in string.gmatch(bad_jobs, '[^,]+') do
    local id, at = string.match(entry, '^(.*)@(%d+)$')
    if id and id ~= drop and now - tonumber(at) < bad_ttl and not has(add, id) then kept[#kept + 1] = entry end
  end
  for id in string.gmatch(add, '[^,]+') do kept[#kept + 1] = id .. '@' .. now end
  bad_jobs = table.concat(kept, ',', math.max(1, #kept - 31))
  set('bad_jobs', bad_jobs)
end
-- Closing after a success. With admit, the jobs that failed since the last success were bad documents, by the
-- evidence (another job was served while the provider was not failing for everyone).
local function close(admit)
  if speaks and (before ~= 'closed' or failures > 0) then
    state = 'closed'
    if admit and fail_jobs ~= '' then keep_bad(fail_jobs, '') end
    set('state', 'closed'); set('failures', 0); set('fail_jobs', ''); set('cooldown_ms', base); set('opened_reason', '')
  end
end
local function failed_job()
  if bad(job) then return end
  if job ~= '' and not has(fail_jobs, job) then
    -- Bounded: a long outage's failed probes keep counting, but only the first 32 jobs are named.
    local _, named = string.gsub(fail_jobs, '[^,]+', '')
    if named < 32 then
      if fail_jobs == '' then fail_jobs = job else fail_jobs = fail_jobs .. ',' .. job end
    end
    failures = failures + 1
    set('fail_jobs', fail_jobs); set('failures', failures)
    if failures == 2 then set('suspect_at', now) end
  elseif job == '' then
    failures = failures + 1
    set('failures', failures)
  end
end
if kind == 'rate_limited' then
  -- The provider answered, so it is up; it asks everyone to slow down.
  local p = retry_after
  if p < 0 then p = math.max(pause_to - now, 1000) end
  p = math.max(p, min_pause)
  if now + p > pause_to then pause_to, why = now + p, 'rate_limited' end
  close(false)
  absorbed = 1
elseif kind == 'quota' then
  -- Every call would fail the same way until someone pays: the provider is unusable.
  if before == 'closed' or (before == 'half_open' and probe) then open('insufficient_quota') end
  absorbed = 1
elseif kind == 'unauthorized' then
  if bad(job) then
    -- A known bad document's 401 or 403 is its own (a gateway refusing its content): charged to it.
  else
    -- A wrong or revoked key fails every call the same way: the provider is unusable until someone fixes it.
    if before == 'closed' or (before == 'half_open' and probe) then failed_job(); open('unauthorized') end
    absorbed = 1
  end
elseif kind == 'provider' then
  if before == 'open' then absorbed = 1
  elseif before == 'half_open' then
    -- A probe by a known bad document (no other job asked to probe) is charged to it: it must not probe and
    -- be absorbed for ever.
    absorbed = 1
    if probe then
      -- A probe by a job that had failed already (it probes only when no fresh job asked) is charged to it: with
      -- no other job to tell, a few poison documents must not probe and be absorbed for ever.
      if bad(job) or has(fail_jobs, job) then absorbed = 0 end
      failed_job(); open('probe_failed')
    end
  elseif bad(job) then
    -- A known bad document failing again says nothing about the provider.
  else
    failed_job()
    if failures >= threshold then open('consecutive_failures'); absorbed = 1 end
  end
elseif kind == 'ok' then
  local _, others = string.gsub(fail_jobs, '[^,]+', '')
  -- Evidence that the jobs that failed since the last success were bad documents: another job was served
  -- while the provider was not failing for everyone (closed, under the threshold), or a fresh job's probe
  -- succeeded after one job's 401 or 403 opened the breaker.
  local admit = not has(fail_jobs, job) and (
    (before == 'closed' and failures > 0 and failures < threshold) or
    (before == 'half_open' and probe and h[14] == 'unauthorized' and others == 1))
  close(admit)
  if bad(job) then keep_bad('', job) end
elseif kind == 'request' then
  close(false)
end
if probe then set('probe_until', 0); set('probe_id', '') end
-- Recent failures by attribution, for provider status.
local attribution = ''
if kind ~= 'ok' and kind ~= 'aborted' then
  if absorbed == 1 then attribution = 'provider' else attribution = 'job' end
  local at = n(h[10])
  local rp, rj = n(h[11]), n(h[12])
  if now - at > window then at, rp, rj = now, 0, 0; set('recent_at', now) end
  if absorbed == 1 then rp = rp + 1 else rj = rj + 1 end
  set('recent_provider', rp); set('recent_job', rj)
end
-- The pause stops every worker: one bad Retry-After or reset header must not stop them for days.
local asked = 0
if pause_to - now > max_pause then asked, pause_to = pause_to - now, now + max_pause end
if pause_to > n(h[6]) then set('pause_until', pause_to); set('pause_reason', why) end
if #f > 0 then redis.call('HSET', key, unpack(f)) end
return {absorbed, before, state, reason, asked, why, attribution}
`,
);

/** A header's wait for the script, in whole ms; -1 when absent. A value of ages stays a finite integer for Lua. */
function durationArg(ms: number | undefined): number {
  return ms === undefined ? -1 : Math.round(Math.min(ms, Number.MAX_SAFE_INTEGER));
}

const STATUS = defineScript(
  PRELUDE + `
return {now, redis.call('HGETALL', key)}
`,
);

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
  const random = options.random ?? Math.random;
  const events = options.events ?? {};
  const cfgRpm = options.rpm ?? 0;
  const cfgTpm = options.tpm ?? 0;
  let waiting = 0;
  // Of those, callers refused the single call because their own job just failed: they must not keep the
  // worker from reading a fresh job, which is the probe they are waiting for.
  let suspects = 0;

  const ask = (
    estimated: number,
    mode: "take" | "peek" | "confirm" | "confirm_probe",
    probeId = "",
    jobId = "",
  ) =>
    ACQUIRE.run(redis, [options.key], [
      cfgRpm,
      cfgTpm,
      estimated,
      maxAheadMs,
      options.probeLeaseMs,
      margin,
      mode,
      FLOW_DEFAULTS.horizonMs,
      probeId,
      jobId,
      FLOW_DEFAULTS.suspectProbeDelayMs,
    ]) as Promise<[number, number, string]>;

  async function settle(estimated: number, probeId: string, outcome: PermitOutcome, jobId = ""): Promise<boolean> {
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
    const [absorbed, from, to, reason, askedMs, pauseReason, attribution] = await SETTLE.run(redis, [options.key], [
      kind,
      estimated,
      // A call the provider refused or never got costs no tokens; a timed-out one may have run, so it keeps them.
      usage?.total_tokens ?? (kind === "ok" || (kind === "provider" && reasonOf(outcome.error) === "timeout") ? -1 : 0),
      probeId,
      outcome.error === undefined ? -1 : durationArg(retryAfterMs(outcome.error)),
      h.limitRequests ?? -1,
      h.limitTokens ?? -1,
      h.remainingRequests ?? -1,
      h.remainingTokens ?? -1,
      durationArg(h.resetRequestsMs),
      durationArg(h.resetTokensMs),
      threshold,
      options.cooldownMs,
      options.cooldownMs * FLOW_DEFAULTS.maxCooldownFactor,
      FLOW_DEFAULTS.cooldownGrowth,
      margin,
      cfgTpm,
      FLOW_DEFAULTS.minPauseMs,
      FLOW_DEFAULTS.maxPauseMs,
      jobId,
      FLOW_DEFAULTS.recentWindowMs,
      FLOW_DEFAULTS.badJobTtlMs,
    ]) as [number, BreakerState, BreakerState, string, number, string, Attribution | ""];
    if (attribution) events.failed?.(attribution, reasonOf(outcome.error));
    if (askedMs > 0) {
      log.warn("provider_pause_capped", {
        reason: pauseReason,
        asked_ms: askedMs,
        applied_ms: FLOW_DEFAULTS.maxPauseMs,
      });
    }
    if (from !== to) {
      events.breaker?.(from, to, reason);
      if (to === "open") {
        // Loud: nothing will be called until a probe succeeds, and an exhausted quota needs a person.
        const event = { insufficient_quota: "provider_quota_exhausted", unauthorized: "provider_unauthorized" }[
          reason as "insufficient_quota" | "unauthorized"
        ] ?? "provider_breaker_opened";
        log.error(event, {
          reason,
          cooldown_s: options.cooldownMs / 1000,
          error: outcome.error,
        });
      } else if (to === "closed") log.info("provider_breaker_closed", { from });
    }
    return absorbed === 1;
  }

  return {
    get waiting() {
      return waiting;
    },

    async acquire(estimatedTokens, signal, jobId = "") {
      const started = performance.now();
      waiting++;
      let booked = false;
      try {
        for (;;) {
          signal?.throwIfAborted();
          const id = crypto.randomUUID();
          const [code, ms, reason] = await ask(estimatedTokens, "take", id, jobId);
          if (code === -1) {
            throw new GateRefused(
              `the call's ${estimatedTokens} estimated tokens exceed the provider's tokens-per-minute limit`,
            );
          }
          if (code > 0) {
            const probe = code === 2;
            const probeId = probe ? id : "";
            if (!booked) waiting--;
            booked = true;
            try {
              if (ms > 0) await sleep(ms, signal);
            } catch (error) {
              if (probe) await settle(estimatedTokens, probeId, { aborted: true }, jobId).catch(() => {});
              throw error;
            }
            // A slot booked ahead is checked again when it comes: the breaker may have opened, or a 429
            // paused everyone, while this caller slept. Then the slot is forfeit and the caller waits.
            if (ms > 0) {
              const [go, again] = await ask(estimatedTokens, probe ? "confirm_probe" : "confirm");
              if (go !== 1) {
                if (probe) await settle(estimatedTokens, probeId, { aborted: true }, jobId);
                waiting++;
                booked = false;
                await sleep(again + random() * 20, signal);
                continue;
              }
            }
            const waitedMs = performance.now() - started;
            events.granted?.(waitedMs, probe);
            return { waitedMs, probe, settle: (outcome) => settle(estimatedTokens, probeId, outcome, jobId) };
          }
          // Spread the callers a pause or an open breaker releases at the same instant.
          const suspect = reason === "suspect";
          if (suspect) suspects++;
          try {
            await sleep(ms + random() * Math.min(100, ms * 0.1 + 10), signal);
          } finally {
            if (suspect) suspects--;
          }
        }
      } finally {
        if (!booked) waiting--;
      }
    },

    async ready() {
      const [raw, ms] = await ask(0, "peek");
      const permits = Math.max(0, raw - (waiting - suspects));
      // Permits this process's own waiters will take are not there for new jobs: look again shortly.
      return { permits, waitMs: permits > 0 ? 0 : raw > 0 ? 50 : ms };
    },

    async status() {
      const [now, flat] = await STATUS.run(redis, [options.key], []) as [number, string[]];
      const f = new Map(Object.entries(fieldsToObject(flat)));
      const num = (name: string) => (f.has(name) && f.get(name) !== "" ? Number(f.get(name)) : null);
      const limit = (configured: number, learned: number | null) => {
        const c = configured > 0 ? configured : null;
        const l = learned !== null && learned > 0 ? learned : null;
        if (c !== null && (l === null || c <= l)) {
          return { limit: c, source: "config" as const, configured: c, learned: l };
        }
        if (l !== null) return { limit: l, source: "headers" as const, configured: c, learned: l };
        return { limit: null, source: "none" as const, configured: c, learned: l };
      };
      const rpm = limit(cfgRpm, num("hdr_rpm"));
      const tpm = limit(cfgTpm, num("hdr_tpm"));
      let state = (f.get("state") ?? "closed") as BreakerState;
      const openUntil = num("open_until");
      if (state === "open" && openUntil !== null && now >= openUntil) state = "half_open";
      const pauseUntil = num("pause_until");
      return {
        key: options.key,
        now,
        rpm,
        tpm,
        learning: rpm.limit === null && tpm.limit === null && f.get("learned") !== "1",
        remaining: { requests: num("hdr_rem_req"), tokens: num("hdr_rem_tok"), headers_at: num("hdr_at") },
        reset: { requests_at: num("hdr_reset_req_at"), tokens_at: num("hdr_reset_tok_at") },
        next_permit_at: Math.max(now, rpm.limit ? num("tat_req") ?? 0 : 0, tpm.limit ? num("tat_tok") ?? 0 : 0),
        recent_failures: (() => {
          const since = num("recent_at");
          const current = since !== null && now - since <= FLOW_DEFAULTS.recentWindowMs;
          return current
            ? { provider: num("recent_provider") ?? 0, job: num("recent_job") ?? 0, since }
            : { provider: 0, job: 0, since: null };
        })(),
        pause: pauseUntil !== null && pauseUntil > now
          ? { until: pauseUntil, reason: f.get("pause_reason") ?? null }
          : { until: null, reason: null },
        breaker: {
          state,
          failures: num("failures") ?? 0,
          reason: f.get("opened_reason") || null,
          opened_at: state === "closed" ? null : num("opened_at"),
          probe_at: state === "closed" ? null : openUntil,
          cooldown_ms: num("cooldown_ms") ?? options.cooldownMs,
        },
      };
    },
  };
}
