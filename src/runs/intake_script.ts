import { defineScript } from "../redis/script.ts";

// INTAKE: the idempotency check, the enqueue, the job's status record and the idempotency record, in one step, for
// each of a batch of submissions (`createIntake` sends the submissions that arrive together in one call).
//
// An idempotency record is a field of a hash its lane's scopes share, one hash per period of the records' lifetime
// (IDEMPOTENCY_RESULT_TTL_S, the period's length too): field the scope's digest (`scopeDigest`), value
// '<expiry, unix seconds>:<the job's fingerprint>' (`jobFingerprint`). The answer is not stored: a replay's is
// rebuilt from the job id, which the fingerprint confirms (the scope and the body name it). A record past its
// expiry is as good as absent; one is found in the hash of its own period or of the one before (it lives one
// period at most), and each hash expires once every record in it has. A scope's job status record is a separate
// key: it is looked up by job id (`GET`, the worker's acknowledgement and dead letters), and the job id, a hash of
// the scope and the body, names no scope.
//
// KEYS[1…n]   the registry sets that make a lane known (`laneKnownArgs`: on one server the lanes with work, then
//             every lane; on a cluster, the lane's home): the same for every submission of the batch (a batch is
//             one tenant's on a cluster). The lane is added to KEYS[1]; only when that set lacked it is it added to
//             the others. Every lane of the call is published, in one message (below).
// KEYS[n+1…]  three per head (below): its lane's records hash of the current period, of the one before, and of the
//             one before that (unlinked when the current one gets its first record: its records have all expired,
//             and a background free spares Redis the stall of its expiry freeing a large hash in line).
// KEYS[…]     then three per submission and its head's `others`: the scope's record as releases before issue 39
//             stored it (a string key: read, never stored anew), the stream of the lane it is queued on (its
//             priority's: `LaneKeys.streamOf`), the job's status record, and, with a cap (`others` > 0), the lane's
//             other streams, which the caps count too (all of them share the lane's hash tag).
// ARGV[1]     '1' when a WAIT follows (REDIS_MIN_REPLICAS_ACK): a found record is then written again, expiry
//             unchanged, because WAIT covers only its own connection's writes and the record may have been
//             written on another one (a first attempt answered 503, another API process) and not replicated yet.
// ARGV[2]     n.
// ARGV[3]     JSON: the heads, what the batch's submissions of one tenant (and task version) share:
//             [{ tenant, cap (the lane's cap, 0 = none), status (the status record's change, `markQueued`),
//             lane (the lane id), others (the lane's other streams among a submission's keys) }, …].
// ARGV[4]     the records' lifetime in seconds. ARGV[5] the lane's share of a full queue (0 = the queue is not
//             full). ARGV[6] the channel to publish a lane on when it gets work, '' for none. ARGV[7] now, in
//             milliseconds since the epoch (the intake's clock, which named the period's hashes). ARGV[8] the
//             current period's hash's lifetime in seconds, set with its first record (to the end of the period
//             after it, when its last record expires, and then the shorter of a minute and a period).
// ARGV[9…]    seven per submission: its head (1-based), the job id, the traceparent ('' when not tracing: the
//             message then has no such field), '1' when a new job is refused (the tenant's budget is spent; a
//             replay is still answered), the payload (the stream entry's), the scope's digest, the job's
//             fingerprint.
// A lane the set KEYS[1] holds already is not added to the others: on one server KEYS[1] is the lanes with work,
// a subset of every lane (nothing takes a lane out of that one). It is published all the same: a lane left in the
// set by a worker that stopped is known to no worker, and an idle one waits for a wake-up (without one, a lane
// posted to after a restart waited for the worker's next read, about half a second in the isolation sequence).
// A worker taking a drained lane out looks at its streams again *after* taking it out (`LaneSource.idle`) and
// finds this job; once out, the next enqueue adds it again. With 20,000 tenants, one submission of a batch in each
// lane, this spares one command of three per submission (README, issue 39, "Lanes at scale").
// Returns, per submission: 4 when the scope's record names this job (a replay; also when the scope had no record
// but the job is still known: it is not enqueued twice, its status is left alone, and the record is stored
// again), 5 when it names another (the key was used with another body), the stored answer of a record of a
// release before issue 39 (the caller compares its fingerprint), 1 when the lane is full, 2 when the whole queue
// is full and this lane holds its share of it, 3 when refused (nothing written in these three), or 0 after
// enqueuing, making the lane known and storing the record, or an error reply (a key of the wrong type) that is
// that submission's alone. The submissions run in order, so a second one with the same key finds the first's
// record.
// Safe to run twice (a resend after a lost reply): each submission the first run enqueued stored its record, so
// the second run finds that record and answers 4 (a replay of the same body): nothing is enqueued twice and no
// lane is made known again. One the first run answered 1, 2 or 3 wrote nothing, and is decided again.
export const INTAKE_SCRIPT = defineScript(`
local n = tonumber(ARGV[2])
local heads = cjson.decode(ARGV[3])
local share = tonumber(ARGV[5])
local now = tonumber(ARGV[7])
local expires = math.floor(now / 1000) + tonumber(ARGV[4])
local first = n + 3 * #heads
local added = {}
local lanes = {}
-- A live record and the fingerprint it holds, or nil.
local function live(records, field)
  local record = redis.call('HGET', records, field)
  if not record then return nil end
  local at, fp = string.match(record, '^(%d+):(.*)$')
  if tonumber(at) * 1000 > now then return record, fp end
  return nil
end
local function store(r, field, fp)
  redis.call('HSET', KEYS[r], field, expires .. ':' .. fp)
  if redis.call('EXPIRE', KEYS[r], ARGV[8], 'NX') == 1 then redis.call('UNLINK', KEYS[r + 2]) end
end
-- The runs a submission's lane holds, over all its streams (its others follow its three keys when a cap is set).
local function queued(k, h)
  local total = redis.call('XLEN', KEYS[k + 1])
  for i = 3, 2 + (h.others or 0) do total = total + redis.call('XLEN', KEYS[k + i]) end
  return total
end
local function submit(k, a)
  local legacy, stream, job = KEYS[k], KEYS[k + 1], KEYS[k + 2]
  local head = tonumber(ARGV[a])
  local h = heads[head]

  local r = n + 3 * head - 2
  local field, fp = ARGV[a + 5], ARGV[a + 6]
  for at = r, r + 1 do
    local record, found = live(KEYS[at], field)
    if record then
      if ARGV[1] == '1' then redis.call('HSET', KEYS[at], field, record) end
      if found == fp then return 4 end
      return 5
    end
  end
  local stored = redis.call('GET', legacy)
  if stored then
    if ARGV[1] == '1' then
      local at = redis.call('PEXPIRETIME', legacy)
      if at > 0 then redis.call('PEXPIREAT', legacy, at) end
    end
    return stored
  end
  if redis.call('EXISTS', job) == 1 then
    store(r, field, fp)
    return 4
  end
  if ARGV[a + 3] == '1' then return 3 end
  if h.cap > 0 and queued(k, h) >= h.cap then return 1 end
  if share > 0 and queued(k, h) >= share then return 2 end
  if ARGV[a + 2] ~= '' then
    redis.call('XADD', stream, '*', 'job_id', ARGV[a + 1], 'tenant', h.tenant, 'payload', ARGV[a + 4],
      'traceparent', ARGV[a + 2])
  else
    redis.call('XADD', stream, '*', 'job_id', ARGV[a + 1], 'tenant', h.tenant, 'payload', ARGV[a + 4])
  end
  -- The record is new (EXISTS said so above): it has no field to delete (status.del).
  redis.call('HSET', job, unpack(h.status.set))
  if h.status.ttl_s > 0 then redis.call('EXPIRE', job, h.status.ttl_s) end
  -- Made known after the loop, once for every lane of the call (below), in the same script as the XADD.
  if not added[h.lane] then
    added[h.lane] = true
    lanes[#lanes + 1] = h.lane
  end
  store(r, field, fp)
  return 0
end
-- Every lane that got work in this call: added to KEYS[1], and those it lacked to the other sets, in one command
-- each however many lanes (on one server a call may hold 64 tenants' submissions). Published whether or not a lane
-- was among those with work: an idle worker waits for a wake-up, and a lane left in that set by a worker that
-- stopped is served by nobody until one comes (or the worker's next walk). One message names them all,
-- space-separated (a tenant name has no space; one lane alone is published as before).
local function announce()
  if #lanes == 0 then return end
  local had = redis.call('SMISMEMBER', KEYS[1], unpack(lanes))
  local fresh = {}
  for i = 1, #lanes do if had[i] == 0 then fresh[#fresh + 1] = lanes[i] end end
  if #fresh > 0 then
    for i = 1, n do redis.call('SADD', KEYS[i], unpack(fresh)) end
  end
  if ARGV[6] ~= '' then redis.call('PUBLISH', ARGV[6], table.concat(lanes, ' ')) end
end
local out = {}
local a = 9
local k = first + 1
while k <= #KEYS do
  -- One submission's error (a key of the wrong type) is its own: the others of the batch go on.
  local ok, result = pcall(submit, k, a)
  if ok then
    out[#out + 1] = result
  elseif type(result) == 'table' and result.err then
    out[#out + 1] = result
  else
    out[#out + 1] = { err = tostring(result) }
  end
  k = k + 3 + (heads[tonumber(ARGV[a])].others or 0)
  a = a + 7
end
announce()
return out`);
