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
-- KEYS[2]  the caller's reply memo (see reply_memo.ts), beside the state; absent for a batch of peeks (they write
--          nothing)
-- ARGV[1]  JSON: the flow's settings {cfg_rpm, cfg_tpm, max_ahead_ms, lease_ms, margin, horizon_ms,
--          suspect_delay_ms, state_ttl_ms, reply_ttl_ms}
-- ARGV[2]  JSON: the requests, in order: [{mode, est (tokens), probe_id, job ('' = unknown)}, ...]
-- ARGV[3]  this call's id, with KEYS[2]
-- Returns {code, ms, detail} for each request, in order, flat. Mode take: code 1 = permit booked ms from now
-- (detail 'unpaced' when no limit is in force, the breaker is closed, nothing is paused and no call has failed
-- since the last success: the caller may then lease permits for a while), 2 = probe permit (lease held by the
-- probe id), 0 = ask again in ms, -1 = this call can never fit the token limit. Mode peek: code = permits within the horizon, ms = wait before asking again. Mode confirm /
-- confirm_probe: a booked slot has come; code 1 = go, 0 = the breaker or a pause stopped it meanwhile (ask again
-- in ms).
-- Safe to run twice: a call whose id the memo holds was resent after its reply was lost (the client resends what
-- was unanswered when it reconnects). It gets the first run's reply back and books nothing: a second slot would be
-- a permit nobody uses, and a probe told to wait for its own lease would stall the probe until the lease ran out.
local key, memo, call = KEYS[1], KEYS[2], ARGV[3]
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
  local single = suspect or (rpm == 0 and tpm == 0 and h[9] ~= '1')
  if single and probe_until > now then return 0, math.min(probe_until - now, 100), 'probing' end
  local bad = job ~= '' and string.find(',' .. (h[13] or '') .. ',', ',' .. job .. '@', 1, true) ~= nil
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
  if req_iv > 0 then tat_req = math.max(now, tat_req) + req_iv end
  if tok_iv > 0 then tat_tok = math.max(now, tat_tok) + est * tok_iv end
  redis.call('HSET', key, 'tat_req', tat_req, 'tat_tok', tat_tok, 'cfg_rpm', cfg_rpm, 'cfg_tpm', cfg_tpm)
  if single then
    redis.call('HSET', key, 'probe_until', now + lease, 'probe_id', probe_id)
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
  const keys = memo ? [key, memo.key] : [key];
  const args = [JSON.stringify(settings), JSON.stringify(requests)];
  if (memo) args.push(memo.callId);
  const flat = await ACQUIRE.run(redis, keys, args) as (number | string)[];
  return requests.map((_, i) => flat.slice(3 * i, 3 * i + 3) as AcquireReply);
}
