import type { RedisClient } from "../clients.ts";
import { defineScript } from "../redis/script.ts";
import type { ReplyMemo } from "./reply_memo.ts";

/** The flow's settings, the same for every request of a batch (one JSON object). */
export interface AcquireSettings {
  cfg_rpm: number;
  cfg_tpm: number;
  max_ahead_ms: number;
  lease_ms: number;
  margin: number;
  horizon_ms: number;
  suspect_delay_ms: number;
  state_ttl_ms: number;
  /** How long a call's reply stays in its memo, for a resend of that call. */
  reply_ttl_ms: number;
  /** This process's id in the live configurations (see the script): with `announce`, its entry is written... */
  owner?: string;
  /** ...to expire after this long (the process refreshes it well before)... */
  cfg_ttl_ms?: number;
  /** ...1 = write or refresh this process's configured limits, -1 = withdraw them (it stops), 0 = neither. */
  announce?: number;
  /** While the limits are unknown, one more call may start this long after the last (absent: one at a time). */
  learn_step_ms?: number;
  /** How long a known bad document stays known (see the settle script). */
  bad_ttl_ms?: number;
  /** The first request slot booked after this long without one counts twice (absent: never). */
  cold_after_ms?: number;
}

/** One caller's request (one JSON object of the batch's array). */
export interface AcquireRequest {
  mode: "take" | "peek" | "confirm" | "confirm_probe";
  /** The call's estimated tokens. */
  est: number;
  probe_id: string;
  /** '' when unknown. */
  job: string;
}

/** `[code, ms, detail]`; see the script's header. */
export type AcquireReply = [number, number, string];

const ACQUIRE = defineScript(`
-- Acquire: asks, for each request of a batch in turn, for the right to make one model call now (or peeks, or
-- confirms a slot booked ahead). A batch of n requests decides exactly what n calls in a row would.
-- KEYS[1]  the provider's state hash
-- KEYS[2]  the live processes' configured limits (a hash beside the state: owner -> 'rpm tpm expires_at_ms')
-- KEYS[3]  the caller's reply memo (see reply_memo.ts), beside the state; absent for a batch of peeks (they book
--          nothing)
-- ARGV[1]  JSON: the flow's settings {cfg_rpm, cfg_tpm, max_ahead_ms, lease_ms, margin, horizon_ms,
--          suspect_delay_ms, state_ttl_ms, reply_ttl_ms, owner, cfg_ttl_ms, announce}
-- ARGV[2]  JSON: the requests, in order: [{mode, est (tokens), probe_id, job ('' = unknown)}, ...]
-- ARGV[3]  this call's id, with KEYS[3]
-- Returns {code, ms, detail} for each request, in order, flat. Mode take: code 1 = permit booked ms from now
-- (detail 'unpaced' when no limit is in force, the breaker is closed, nothing is paused and no call has failed
-- since the last success: the caller may then lease permits for a while), 2 = probe permit (lease held by the
-- probe id), 0 = ask again in ms, -1 = this call can never fit the token limit. Mode peek: code = permits within the horizon, ms = wait before asking again. Mode confirm /
-- confirm_probe: a booked slot has come; code 1 = go, 0 = the breaker or a pause stopped it meanwhile (ask again
-- in ms).
-- Safe to run twice: a call whose id the memo holds was resent after its reply was lost (the client resends what
-- was unanswered when it reconnects). It gets the first run's reply back and books nothing: a second slot would be
-- a permit nobody uses, and a probe told to wait for its own lease would stall the probe until the lease ran out.
local key, cfgs, memo, call = KEYS[1], KEYS[2], KEYS[3], ARGV[3]
if memo then
  local last = redis.call('GET', memo)
  if last and string.sub(last, 1, #call + 1) == call .. ' ' then return cmsgpack.unpack(string.sub(last, #call + 2)) end
end
local s = cjson.decode(ARGV[1])
local cfg_rpm, cfg_tpm = s.cfg_rpm, s.cfg_tpm
local max_ahead, lease, margin = s.max_ahead_ms, s.lease_ms, s.margin
local horizon, suspect_delay = s.horizon_ms, s.suspect_delay_ms
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function n(v) return tonumber(v) or 0 end
local function lower(x, y) if x > 0 and y > 0 then return math.min(x, y) end return math.max(x, y) end
-- A configured limit is the configuration of the processes running now: each writes its own entry with an expiry
-- and refreshes it well before, and withdraws it when it stops. The limit in force is the strictest a live process
-- configures (and always at least this process's own), so a process stopped or restarted with another
-- configuration stops counting within cfg_ttl_ms. The state hash keeps the live figures and the first expiry.
local live = redis.call('HMGET', key, 'live_rpm', 'live_tpm', 'live_next')
local live_rpm, live_tpm, cfg_next = n(live[1]), n(live[2]), n(live[3])
local announce = s.announce or 0
if announce ~= 0 and s.owner then
  if announce > 0 then
    redis.call('HSET', cfgs, s.owner, cfg_rpm .. ' ' .. cfg_tpm .. ' ' .. (now + s.cfg_ttl_ms))
    redis.call('PEXPIRE', cfgs, 2 * s.cfg_ttl_ms)
  else
    redis.call('HDEL', cfgs, s.owner)
  end
end
if announce ~= 0 or (cfg_next > 0 and now >= cfg_next) then
  live_rpm, live_tpm, cfg_next = 0, 0, 0
  local all = redis.call('HGETALL', cfgs)
  for i = 1, #all, 2 do
    local r, tk, at = string.match(all[i + 1], '^(%d+) (%d+) (%d+)$')
    if not at or tonumber(at) <= now then
      redis.call('HDEL', cfgs, all[i])
    else
      live_rpm, live_tpm = lower(live_rpm, tonumber(r)), lower(live_tpm, tonumber(tk))
      if cfg_next == 0 or tonumber(at) < cfg_next then cfg_next = tonumber(at) end
    end
  end
  redis.call('HSET', key, 'live_rpm', live_rpm, 'live_tpm', live_tpm, 'live_next', cfg_next)
end
cfg_rpm, cfg_tpm = lower(cfg_rpm, live_rpm), lower(cfg_tpm, live_tpm)
-- Lists of job ids, comma-separated.
local function has(list, id) return id ~= '' and string.find(',' .. (list or '') .. ',', ',' .. id .. ',', 1, true) ~= nil end
local function one(mode, est, probe_id, job)
  local peek, confirm = mode == 'peek', mode == 'confirm' or mode == 'confirm_probe'
  local h = redis.call('HMGET', key, 'state', 'open_until', 'probe_until', 'pause_until', 'tat_req', 'tat_tok',
    'hdr_rpm', 'hdr_tpm', 'learned', 'failures', 'fail_jobs', 'suspect_at', 'bad_jobs')
  local state = h[1] or 'closed'
  local open_until, probe_until, pause_until = n(h[2]), n(h[3]), n(h[4])
  local tat_req, tat_tok = n(h[5]), n(h[6])
  local rpm, tpm = lower(cfg_rpm, n(h[7])), lower(cfg_tpm, n(h[8]))
  if state == 'open' then
    if now < open_until then return 0, open_until - now, 'breaker_open' end
    state = 'half_open'
    if not peek then redis.call('HSET', key, 'state', 'half_open') end
  end
  if pause_until > now then return 0, pause_until - now, 'paused' end
  if mode == 'confirm_probe' then return 1, 0, 'probe' end
  -- One call at a time while probing a suspect (two jobs failed in a row) or half-open provider, or while the
  -- limits are unknown. That call goes to a job that has not just failed, unless none asked for a while.
  local suspect = state == 'half_open' or n(h[10]) >= 2
  local learning = rpm == 0 and tpm == 0 and h[9] ~= '1'
  local single = suspect or learning
  if single and probe_until > now then
    -- A half-open breaker's probe is out: the provider is not known to be back yet (callers that may go elsewhere do).
    return 0, math.min(probe_until - now, 100), state == 'half_open' and 'half_open' or 'probing'
  end
  local bad = false
  if job ~= '' then
    local list = ',' .. (h[13] or '') .. ','
    local i = string.find(list, ',' .. job .. '@', 1, true)
    local at = i and tonumber(string.match(list, '^(%d+)', i + #job + 2))
    bad = at ~= nil and now - at < (s.bad_ttl_ms or 600000)
  end
  if suspect and not peek and mode ~= 'confirm' and (has(h[11], job) or bad) then
    local since = n(h[12])
    if state == 'half_open' then since = math.max(since, open_until) end
    if now - since < suspect_delay then return 0, since + suspect_delay - now, 'suspect' end
  end
  if confirm then
    if single then return 0, 0, 'probing' end
    return 1, 0, 'permit'
  end
  local req_iv, tok_iv = 0, 0
  if rpm > 0 then req_iv = 60000 / (rpm * margin) end
  if tpm > 0 then tok_iv = 60000 / (tpm * margin) end
  local start = now
  if req_iv > 0 and tat_req > start then start = tat_req end
  if tok_iv > 0 and tat_tok > start then start = tat_tok end
  local wait = start - now
  if tpm > 0 and est > tpm then return -1, 0, 'too_large' end
  if peek then
    if single then return 1, 0, 'probe' end
    if wait > horizon then return 0, math.ceil(wait - horizon), 'pacing' end
    if req_iv == 0 then return 1000000, 0, 'unlimited' end
    return math.floor((horizon - wait) / req_iv) + 1, 0, 'pacing'
  end
  if wait > max_ahead then return 0, math.ceil(wait - max_ahead), 'pacing' end
  -- Book the slot: the next caller's earliest start moves one interval (and this call's tokens) later.
  if req_iv > 0 then
    -- The first call after a quiet spell (or the first paced one after the limits were learned) counts twice. The
    -- provider counts arrivals, we pace grants: that call may arrive late (a new connection) or follow calls made
    -- while the limits were unknown, which booked nothing; one slot left free keeps the provider's first second
    -- at the limit.
    local cold = s.cold_after_ms and tat_req + s.cold_after_ms <= now
    tat_req = math.max(now, tat_req) + req_iv
    if cold then tat_req = tat_req + req_iv end
  end
  if tok_iv > 0 then tat_tok = math.max(now, tat_tok) + est * tok_iv end
  redis.call('HSET', key, 'tat_req', tat_req, 'tat_tok', tat_tok)
  if single then
    -- While only learning the limits (nothing failing), the next call may start learn_step_ms later, so one call
    -- that hangs before the first answer holds up the others for that long, not for a call's whole timeout.
    local hold = lease
    if not suspect and s.learn_step_ms then hold = math.min(lease, s.learn_step_ms) end
    redis.call('HSET', key, 'probe_until', now + hold, 'probe_id', probe_id)
    return 2, math.ceil(wait), 'probe'
  end
  if req_iv == 0 and tok_iv == 0 and n(h[10]) == 0 then return 1, 0, 'unpaced' end
  return 1, math.ceil(wait), 'permit'
end
local out = {}
local booked = false
for _, r in ipairs(cjson.decode(ARGV[2])) do
  local code, ms, detail = one(r.mode, r.est, r.probe_id, r.job)
  if r.mode == 'take' and code > 0 then booked = true end
  out[#out + 1] = code; out[#out + 1] = ms; out[#out + 1] = detail
end
if booked then redis.call('PEXPIRE', key, s.state_ttl_ms) end
if memo then redis.call('SET', memo, call .. ' ' .. cmsgpack.pack(out), 'PX', s.reply_ttl_ms) end
return out
`);

/** The hash of the live processes' configured limits, beside the provider's state `key` (one cluster slot). */
export function liveConfigKey(key: string): string {
  return `${key}:config`;
}

/**
 * Runs the acquire script on the provider state hash `key` for a batch of requests, decided in order. With
 * `memo`, the call is safe to apply twice (the same `memo.callId` again gets the first reply and books nothing);
 * without, the batch must only peek.
 * @returns one reply per request, in order.
 */
export async function runAcquire(
  redis: RedisClient,
  key: string,
  settings: AcquireSettings,
  requests: AcquireRequest[],
  memo?: ReplyMemo,
): Promise<AcquireReply[]> {
  const keys = memo ? [key, liveConfigKey(key), memo.key] : [key, liveConfigKey(key)];
  const args = [JSON.stringify(settings), JSON.stringify(requests)];
  if (memo) args.push(memo.callId);
  const flat = await ACQUIRE.run(redis, keys, args) as (number | string)[];
  return requests.map((_, i) => flat.slice(3 * i, 3 * i + 3) as AcquireReply);
}
