import type { RedisClient } from "../clients.ts";
import { defineScript } from "../redis/script.ts";
import type { ReplyMemo } from "./reply_memo.ts";

/** The flow's settings, the same for every outcome of a batch (one JSON object). */
export interface SettleSettings {
  threshold: number;
  cooldown_ms: number;
  max_cooldown_ms: number;
  growth: number;
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
local threshold, base, maxc, growth = s.threshold, s.cooldown_ms, s.max_cooldown_ms, s.growth
local margin, cfg_tpm, min_pause, max_pause = s.margin, s.cfg_tpm, s.min_pause_ms, s.max_pause_ms
local window, bad_ttl = s.window_ms, s.bad_ttl_ms
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function n(v) return tonumber(v) or 0 end
local function lower(x, y) if x > 0 and y > 0 then return math.min(x, y) end return math.max(x, y) end
local function has(list, id) return id ~= '' and string.find(',' .. (list or '') .. ',', ',' .. id .. ',', 1, true) ~= nil end
local function one(a)
  local kind = a.kind
  local est, actual, probe_id, retry_after = a.est, a.actual, a.probe_id, a.retry_after_ms
  local lim_req, lim_tok, rem_req, rem_tok = a.limit_req, a.limit_tok, a.remaining_req, a.remaining_tok
  local reset_req, reset_tok = a.reset_req_ms, a.reset_tok_ms
  local job = a.job
  local h = redis.call('HMGET', key, 'state', 'failures', 'cooldown_ms', 'tat_tok', 'hdr_tpm', 'pause_until',
    'open_until', 'probe_id', 'fail_jobs', 'recent_at', 'recent_provider', 'recent_job', 'bad_jobs', 'opened_reason')
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
  -- A comma-separated list of job ids.
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
      set('state', 'closed'); set('failures', 0); set('fail_jobs', ''); set('cooldown_ms', base)
      set('opened_reason', '')
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
