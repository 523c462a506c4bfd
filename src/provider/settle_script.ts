import type { RedisClient } from "../clients.ts";
import { defineScript } from "../redis/script.ts";
import type { ReplyMemo } from "./reply_memo.ts";

/** The flow's settings, the same for every outcome of a batch (one JSON object). */
export interface SettleSettings {
  /** Distinct jobs failing in a row with provider-wide kinds (connection, 502, 503, 504, a Retry-After) that open. */
  threshold: number;
  /** The wait before the first probe of an open breaker... */
  cooldown_ms: number;
  /** ...doubled (`growth`) while fresh probes fail, up to this (LLM_BREAKER_COOLDOWN_S). */
  max_cooldown_ms: number;
  growth: number;
  /**
   * Failures a document can cause (a 500, a timeout) open only as a share: at least `share` of the calls over the
   * last `share_window_ms` failed, among at least `min_calls` calls, from `threshold` distinct jobs of at least
   * `min_tenants` tenants, or from `lone_jobs` distinct jobs of one tenant. Absent: the breaker counts
   * every failure as provider-wide (the scripts' callers before issue 36).
   */
  share?: number;
  share_window_ms?: number;
  min_calls?: number;
  min_tenants?: number;
  lone_jobs?: number;
  margin: number;
  cfg_tpm: number;
  min_pause_ms: number;
  max_pause_ms: number;
  window_ms: number;
  bad_ttl_ms: number;
  /** How long a call's reply stays in its memo, for a resend of that call. */
  reply_ttl_ms: number;
}

/** How one call ended (one JSON object of the batch's array). */
export interface SettleOutcome {
  kind: string;
  est: number;
  /** Tokens the provider counted; -1 = unknown (keep the estimate), 0 = never ran. */
  actual: number;
  probe_id: string;
  retry_after_ms: number;
  limit_req: number;
  limit_tok: number;
  remaining_req: number;
  remaining_tok: number;
  reset_req_ms: number;
  reset_tok_ms: number;
  job: string;
  /** 1 when the failure cannot be one document's (a connection error, 502, 503, 504, a Retry-After). */
  wide?: number;
  /** The job's tenant, hashed ('' = unknown). */
  tenant?: string;
  /** 1 when the answer carried headers but no rate limits: the provider no longer reports them. */
  unreported?: number;
}

/** `[absorbed, before, after, reason, asked ms, pause reason, attribution]`; see the script's header. */
export type SettleReply = [number, Breaker, Breaker, string, number, string, "provider" | "job" | ""];

type Breaker = "closed" | "open" | "half_open";

const SETTLE = defineScript(`
-- Settle: reports how calls that held permits ended, each outcome of a batch in turn (a batch of n decides
-- exactly what n settles in a row would). Each settles its token reservation, learns the limits from the
-- headers, and moves the shared pause and the breaker.
-- KEYS[1]  the provider's state hash
-- KEYS[2]  the caller's reply memo (see reply_memo.ts), beside the state
-- ARGV[1]  JSON: the flow's settings {threshold, cooldown_ms, max_cooldown_ms, growth, margin, cfg_tpm,
--          min_pause_ms, max_pause_ms, window_ms, bad_ttl_ms, reply_ttl_ms}
-- ARGV[2]  JSON: the outcomes, in order: [{kind, est, actual (-1 = unknown), probe_id ('' = not a probe),
--          retry_after_ms, limit_req, limit_tok, remaining_req, remaining_tok, reset_req_ms, reset_tok_ms (each -1
--          when absent), job ('' = unknown)}, ...]
-- ARGV[3]  this call's id
-- Returns {absorbed, state before, state after, reason, asked ms, pause reason, attribution} for each outcome,
-- in order, flat: asked ms is the pause the headers asked for when it was cut to max pause ms, else 0.
-- Safe to run twice: a call whose id the memo holds was resent after its reply was lost (the client resends what
-- was unanswered when it reconnects). It gets the first run's reply back and changes nothing: run again, it would
-- give the unused tokens back twice (letting calls past the limit), count a failure twice, and answer that the
-- breaker it had just opened was open already (its caller would never log the opening).
local key, memo, call = KEYS[1], KEYS[2], ARGV[3]
local last = redis.call('GET', memo)
if last and string.sub(last, 1, #call + 1) == call .. ' ' then return cmsgpack.unpack(string.sub(last, #call + 2)) end
local s = cjson.decode(ARGV[1])
local threshold, first, maxc, growth = s.threshold, s.cooldown_ms, s.max_cooldown_ms, s.growth
local margin, cfg_tpm, min_pause, max_pause = s.margin, s.cfg_tpm, s.min_pause_ms, s.max_pause_ms
local window, bad_ttl = s.window_ms, s.bad_ttl_ms
-- Without share settings every failure counts as provider-wide, as before issue 36.
local by_share = s.share ~= nil
local share, share_ms = s.share or 0, s.share_window_ms or 10000
local min_calls, min_tenants, lone_jobs = s.min_calls or 0, s.min_tenants or 1, s.lone_jobs or threshold
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function n(v) return tonumber(v) or 0 end
local function lower(x, y) if x > 0 and y > 0 then return math.min(x, y) end return math.max(x, y) end
local function has(list, id) return id ~= '' and string.find(',' .. (list or '') .. ',', ',' .. id .. ',', 1, true) ~= nil end
local function count(list) local _, k = string.gsub(list or '', '[^,]+', ''); return k end
-- Adds id to a comma-separated list of at most 32 distinct ids.
local function add(list, id)
  if id == '' or has(list, id) or count(list) >= 32 then return list end
  if list == '' then return id end
  return list .. ',' .. id
end
local function without(list, drop)
  local kept = {}
  for id in string.gmatch(list, '[^,]+') do if not has(drop, id) then kept[#kept + 1] = id end end
  return table.concat(kept, ',')
end
local function one(a)
  local kind = a.kind
  local est, actual, probe_id, retry_after = a.est, a.actual, a.probe_id, a.retry_after_ms
  local lim_req, lim_tok, rem_req, rem_tok = a.limit_req, a.limit_tok, a.remaining_req, a.remaining_tok
  local reset_req, reset_tok = a.reset_req_ms, a.reset_tok_ms
  local job, tenant, wide = a.job, a.tenant or '', (a.wide == 1) or not by_share
  local h = redis.call('HMGET', key, 'state', 'failures', 'cooldown_ms', 'tat_tok', 'hdr_tpm', 'pause_until',
    'open_until', 'probe_id', 'fail_jobs', 'recent_at', 'recent_provider', 'recent_job', 'bad_jobs', 'open_cause',
    'fail_tenants', 'wide_jobs', 'w_at', 'w_calls', 'w_fails', 'w_pcalls', 'w_pfails', 'live_tpm', 'hdr_rpm',
    'wide_anon')
  -- Only the current probe speaks for the provider while the breaker is open or half-open: a call that started
  -- before it opened, or a probe whose lease ran out and was replaced, must not move it.
  local probe = probe_id ~= '' and h[8] == probe_id
  local state = h[1] or 'closed'
  if state == 'open' and now >= n(h[7]) then state = 'half_open' end
  local before, failures, cooldown = state, n(h[2]), n(h[3])
  if cooldown <= 0 then cooldown = first end
  local f = {}
  local function set(k, v) f[#f + 1] = k; f[#f + 1] = v end
  local reason = ''
  -- Learn the limits. A provider that answers without the headers is not paced by them, and one that stops
  -- sending them (a success with headers but none of the limits) no longer is: a learned limit ends there.
  local heard = lim_req >= 0 or lim_tok >= 0
  local tpm = n(h[5])
  if lim_req >= 0 then set('hdr_rpm', lim_req) end
  if lim_tok >= 0 then set('hdr_tpm', lim_tok); tpm = lim_tok end
  if rem_req >= 0 then set('hdr_rem_req', rem_req) end
  if rem_tok >= 0 then set('hdr_rem_tok', rem_tok) end
  if reset_req >= 0 then set('hdr_reset_req_at', now + reset_req) end
  if reset_tok >= 0 then set('hdr_reset_tok_at', now + reset_tok) end
  if heard then set('hdr_at', now) end
  if kind == 'ok' and a.unreported == 1 and ((h[5] or '') ~= '' or (h[23] or '') ~= '') then
    set('hdr_rpm', ''); set('hdr_tpm', ''); set('hdr_rem_req', ''); set('hdr_rem_tok', ''); set('hdr_gone_at', now)
    tpm = 0
  end
  if heard or kind == 'ok' or kind == 'request' or kind == 'rate_limited' then set('learned', '1') end
  -- Settle the token reservation against what the provider counted, at the limit in force: this process's
  -- configuration, the live processes' (see the acquire script), and the learned one.
  tpm = lower(lower(cfg_tpm, n(h[22])), tpm)
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
  -- Jobs whose calls failed since the last success (at most 32 named): a job that fails again and again counts
  -- once. Of those, the ones whose failures could not be their document's, and the tenants of all of them.
  local fail_jobs, wide_jobs, fail_tenants = h[9] or '', h[16] or '', h[15] or ''
  -- Known bad documents, as 'job@ms' entries (at most 32, none older than bad_ttl): jobs whose calls failed
  -- while the provider served other jobs. Their failures are theirs alone, even as a probe, and count nowhere.
  local bad_jobs = h[13] or ''
  local function bad(id)
    if id == '' then return false end
    local list = ',' .. bad_jobs .. ','
    local i = string.find(list, ',' .. id .. '@', 1, true)
    if not i then return false end
    local at = tonumber(string.match(list, '^(%d+)', i + #id + 2))
    return at ~= nil and now - at < bad_ttl
  end
  local known_bad = bad(job)
  -- Calls and failures over a sliding window of share_ms: this bucket's counts, and the last bucket's weighted by
  -- the part of it the window still covers. Known bad documents' calls are not in it.
  local w_at, w_calls, w_fails, w_pcalls, w_pfails = n(h[17]), n(h[18]), n(h[19]), n(h[20]), n(h[21])
  if now - w_at >= 2 * share_ms then w_at, w_calls, w_fails, w_pcalls, w_pfails = now, 0, 0, 0, 0
  elseif now - w_at >= share_ms then w_at, w_pcalls, w_pfails, w_calls, w_fails = w_at + share_ms, w_calls, w_fails, 0, 0 end
  if (kind == 'ok' or kind == 'provider') and not known_bad then
    w_calls = w_calls + 1
    if kind == 'provider' then w_fails = w_fails + 1 end
    set('w_at', w_at); set('w_calls', w_calls); set('w_fails', w_fails); set('w_pcalls', w_pcalls); set('w_pfails', w_pfails)
  end
  -- The minimum number of calls guards a share against chance while the provider serves some; with no success in
  -- the window it does not apply (one call at a time to a hanging provider makes one failure per timeout).
  local function failing_share()
    local k = 1 - (now - w_at) / share_ms
    local calls, fails = w_calls + w_pcalls * k, w_fails + w_pfails * k
    if calls <= 0 or (calls < min_calls and fails < calls) then return 0 end
    return fails / calls
  end
  local function keep_bad(add_list, drop)
    local kept = {}
    for entry in string.gmatch(bad_jobs, '[^,]+') do
      local id, at = string.match(entry, '^(.*)@(%d+)$')
      if id and id ~= drop and now - tonumber(at) < bad_ttl and not has(add_list, id) then kept[#kept + 1] = entry end
    end
    for id in string.gmatch(add_list, '[^,]+') do kept[#kept + 1] = id .. '@' .. now end
    bad_jobs = table.concat(kept, ',', math.max(1, #kept - 31))
    set('bad_jobs', bad_jobs)
  end
  local absorbed = 0
  -- Opens the breaker for reason r. The first probe goes out soon (cooldown_ms); a failed probe of a half-open
  -- breaker reopens it with the wait doubled (grow), up to max_cooldown_ms, unless the prober was a job that had
  -- failed already: that proves nothing new, and the wait stays.
  local function open(r, grow)
    if before == 'half_open' then
      if grow then cooldown = math.min(cooldown * growth, maxc) end
    else
      cooldown = first
      set('open_cause', r)
      -- A call granted before it opened (the single call of a suspect provider) is not its probe: its answer
      -- changes nothing, and it does not hold off the first probe.
      set('probe_id', ''); set('probe_until', 0)
    end
    state, reason = 'open', r
    set('state', 'open'); set('open_until', now + cooldown); set('cooldown_ms', cooldown)
    set('opened_reason', r); set('opened_at', now)
  end
  local speaks = probe or before == 'closed'
  -- Closing after a success. With admit, the jobs that failed since the last success by kinds a document can
  -- cause were bad documents, by the evidence (another job was served while the provider was not failing for
  -- everyone, or a fresh job's probe succeeded after such failures opened the breaker).
  local function close(admit)
    if speaks and (before ~= 'closed' or failures > 0) then
      state = 'closed'
      if admit and fail_jobs ~= '' then keep_bad(without(fail_jobs, wide_jobs), '') end
      set('state', 'closed'); set('failures', 0); set('fail_jobs', ''); set('wide_jobs', ''); set('fail_tenants', '')
      set('wide_anon', 0)
      set('cooldown_ms', first); set('opened_reason', ''); set('open_cause', '')
    end
  end
  local function failed_job()
    if known_bad then return end
    if job ~= '' and not has(fail_jobs, job) then
      -- Bounded: a long outage's failed probes keep counting, but only the first 32 jobs are named.
      fail_jobs = add(fail_jobs, job)
      failures = failures + 1
      set('fail_jobs', fail_jobs); set('failures', failures)
      if failures == 2 then set('suspect_at', now) end
    elseif job == '' then
      failures = failures + 1
      set('failures', failures)
    end
    if wide and job ~= '' then wide_jobs = add(wide_jobs, job); set('wide_jobs', wide_jobs) end
    if wide and job == '' then set('wide_anon', n(h[24]) + 1); h[24] = n(h[24]) + 1 end
    if tenant ~= '' and count(fail_tenants) < 8 then fail_tenants = add(fail_tenants, tenant); set('fail_tenants', fail_tenants) end
  end
  -- The evidence that the provider, not some documents, is failing (see the README's rule): distinct jobs in a
  -- row failing in ways no document causes; or, for failures a document can cause, a failing share of the
  -- calls, from jobs of several tenants (or many jobs of one).
  local function outage()
    local wides = count(wide_jobs) + n(h[24])
    if wides >= threshold then return 'consecutive_failures' end
    if not by_share then return nil end
    local tenants = count(fail_tenants)
    if failures >= threshold and (tenants >= min_tenants or failures >= lone_jobs) and failing_share() >= share then
      return 'failure_rate'
    end
    return nil
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
    if before == 'closed' or (before == 'half_open' and probe) then open('insufficient_quota', true) end
    absorbed = 1
  elseif kind == 'unauthorized' then
    if known_bad then
      -- A known bad document's 401 or 403 is its own (a gateway refusing its content): charged to it.
    else
      -- A wrong or revoked key fails every call the same way: the provider is unusable until someone fixes it.
      if before == 'closed' or (before == 'half_open' and probe) then
        failed_job(); open('unauthorized', true)
      end
      absorbed = 1
    end
  elseif kind == 'provider' then
    if before == 'open' then absorbed = 1
    elseif before == 'half_open' then
      absorbed = 1
      if probe then
        -- A probe by a job that had failed already (it probes only when no fresh job asked) is charged to it: with
        -- no other job to tell, a few poison documents must not probe and be absorbed for ever.
        local fresh = not (known_bad or has(fail_jobs, job))
        -- A failure no document causes is the provider's whoever probed: absorbed, and the wait grows.
        if not fresh and not wide then absorbed = 0 end
        failed_job()
        open('probe_failed', fresh or wide)
      end
    elseif known_bad then
      -- A known bad document failing again says nothing about the provider.
    else
      failed_job()
      local why_open = outage()
      if why_open then
        open(why_open)
        -- Failures no document causes are the provider's: absorbed. A failing share of the others may still be
        -- this job's own document: charged, so a poison document's calls stay within its bound either way.
        if why_open == 'consecutive_failures' then absorbed = 1 end
      end
    end
  elseif kind == 'ok' then
    -- Evidence that the jobs that failed since the last success were bad documents: another job was served
    -- while the provider was not failing for everyone (closed), or a fresh job's probe succeeded after failures
    -- a document can cause opened the breaker, or after one job's 401 or 403 did.
    local cause = h[14] or ''
    local admit = not has(fail_jobs, job) and (
      (before == 'closed' and failures > 0) or
      (before == 'half_open' and probe and (cause == 'failure_rate' or (cause == 'unauthorized' and count(fail_jobs) == 1))))
    close(admit)
    if known_bad then keep_bad('', job) end
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
end
local out = {}
for _, a in ipairs(cjson.decode(ARGV[2])) do
  for _, v in ipairs(one(a)) do out[#out + 1] = v end
end
redis.call('SET', memo, call .. ' ' .. cmsgpack.pack(out), 'PX', s.reply_ttl_ms)
return out
`);

/**
 * Runs the settle script on the provider state hash `key` for a batch of outcomes, applied in order. Safe to apply
 * twice: the same `memo.callId` again gets the first reply and changes nothing.
 * @returns one reply per outcome, in order.
 */
export async function runSettle(
  redis: RedisClient,
  key: string,
  settings: SettleSettings,
  outcomes: SettleOutcome[],
  memo: ReplyMemo,
): Promise<SettleReply[]> {
  const flat = await SETTLE.run(redis, [key, memo.key], [
    JSON.stringify(settings),
    JSON.stringify(outcomes),
    memo.callId,
  ]) as unknown[];
  return outcomes.map((_, i) => flat.slice(7 * i, 7 * i + 7) as SettleReply);
}
