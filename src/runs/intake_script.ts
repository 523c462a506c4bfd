import { defineScript } from "../redis/script.ts";

// INTAKE: the idempotency check, the enqueue, the job's status record and the stored answer, in one step, for
// each of a batch of submissions (`createIntake` sends the submissions that arrive together in one call).
// KEYS[1…n]   the registry sets that make a lane known (`laneKnownArgs`; on a cluster, the lane's home): the same
//             for every submission of the batch (a batch is one tenant's on a cluster).
// KEYS[n+1…]  three per submission: the scope's idempotency record, the lane's intake stream (`LaneKeys.stream`;
//             the per-tenant cap counts it alone, the only stream of a lane any API writes), the job's status
//             record (the three share the lane's hash tag).
// ARGV[1]     '1' when a WAIT follows (REDIS_MIN_REPLICAS_ACK): a found record is then written again, expiry
//             unchanged, because WAIT covers only its own connection's writes and the record may have been
//             written on another one (a first attempt answered 503, another API process) and not replicated yet.
// ARGV[2]     n.
// ARGV[3]     JSON: the heads, what the batch's submissions of one tenant (and task version) share:
//             [{ tenant, cap (the lane's cap, 0 = none), status (the status record's change, `markQueued`),
//             lane (the lane id) }, …].
// ARGV[4]     the stored answer's lifetime in seconds. ARGV[5] the lane's share of a full queue (0 = the queue is
//             not full). ARGV[6] the channel to publish a lane on when it gets work, '' for none.
// ARGV[7…]    six per submission: its head (1-based), the job id, the traceparent ('' when not tracing: the
//             message then has no such field), '1' when a new job is refused (the tenant's budget is spent; a
//             replay is still answered), the payload (the stream entry's), the stored answer (the record).
// Returns, per submission: the existing record (or ours, stored again, when the key's record expired but the
// job is still known: it is not enqueued twice and its status is left alone), 1 when the lane is full, 2 when
// the whole queue is full and this lane holds its share of it, 3 when refused (nothing written in these), or 0
// after enqueuing, making the lane known and storing ours, or an error reply (a key of the wrong type) that is
// that submission's alone. The submissions run in order, so a second one with the same key finds the first's
// record.
// Safe to run twice (a resend after a lost reply): each submission the first run enqueued stored its record, so
// the second run finds that record and answers it (a replay of the same body): nothing is enqueued twice and no
// lane is made known again. One the first run answered 1, 2 or 3 wrote nothing, and is decided again.
export const INTAKE_SCRIPT = defineScript(`
local n = tonumber(ARGV[2])
local heads = cjson.decode(ARGV[3])
local ttl = ARGV[4]
local share = tonumber(ARGV[5])
local added = {}
local function submit(k, a)
  local record, stream, job = KEYS[k], KEYS[k + 1], KEYS[k + 2]
  local h = heads[tonumber(ARGV[a])]
  local stored = redis.call('GET', record)
  if stored then
    if ARGV[1] == '1' then
      local at = redis.call('PEXPIRETIME', record)
      if at > 0 then redis.call('PEXPIREAT', record, at) end
    end
    return stored
  end
  if redis.call('EXISTS', job) == 1 then
    redis.call('SET', record, ARGV[a + 5], 'EX', ttl)
    return ARGV[a + 5]
  end
  if ARGV[a + 3] == '1' then return 3 end
  if h.cap > 0 and redis.call('XLEN', stream) >= h.cap then return 1 end
  if share > 0 and redis.call('XLEN', stream) >= share then return 2 end
  if ARGV[a + 2] ~= '' then
    redis.call('XADD', stream, '*', 'job_id', ARGV[a + 1], 'tenant', h.tenant, 'payload', ARGV[a + 4],
      'traceparent', ARGV[a + 2])
  else
    redis.call('XADD', stream, '*', 'job_id', ARGV[a + 1], 'tenant', h.tenant, 'payload', ARGV[a + 4])
  end
  -- The record is new (EXISTS said so above): it has no field to delete (status.del).
  redis.call('HSET', job, unpack(h.status.set))
  if h.status.ttl_s > 0 then redis.call('EXPIRE', job, h.status.ttl_s) end
  if not added[h.lane] then
    added[h.lane] = true
    for i = 1, n do redis.call('SADD', KEYS[i], h.lane) end
    if ARGV[6] ~= '' then redis.call('PUBLISH', ARGV[6], h.lane) end
  end
  redis.call('SET', record, ARGV[a + 5], 'EX', ttl)
  return 0
end
local out = {}
local a = 7
for k = n + 1, #KEYS, 3 do
  -- One submission's error (a key of the wrong type) is its own: the others of the batch go on.
  local ok, result = pcall(submit, k, a)
  if ok then
    out[#out + 1] = result
  elseif type(result) == 'table' and result.err then
    out[#out + 1] = result
  else
    out[#out + 1] = { err = tostring(result) }
  end
  a = a + 6
end
return out`);
