import { defineScript } from "../redis/script.ts";

// TAKE_WITHIN_CAP: reads new messages of a lane for a consumer from its streams (a lane has one per priority), but
// never more than leave `cap` pending in the group across all the lane's streams and all consumers: a tenant's
// in-flight cap, checked and taken in one step. While several streams hold undelivered messages, each gets its
// share of the messages taken (ARGV[8…]; high 16, normal 4, low 1 in the service) by stride scheduling: every
// stream has a pass, advanced by 1/share per message taken from it; the stream with the lowest pass goes next, as
// many messages as keep it lowest; a stream that had nothing starts again at the lane's virtual time (the pass last
// served) plus its stride, so an idle stream banks no credit. Without the lane's priority state (a caller that names none), the
// streams are read in their order, the next for what the first did not have. With one stream holding messages
// (the usual lane), no share or state is looked at.
// KEYS[1]      the consumer's take record in the lane (takeRecordKey): the last take's id and the entries it
//              delivered, stream by stream as `<index of the stream in KEYS>:<id>,<id>…;…` (one number per stream,
//              not per entry: this script's cost is most of a worker's Redis time on a busy lane).
// KEYS[2…n+1]  the lane's n streams (one slot: they share the lane's hash tag).
// KEYS[n+2]    the lane's priority state (a hash: each stream's pass by index in KEYS, and `v`), when ARGV[7] is set.
// ARGV[1]  the group.
// ARGV[2]  the consumer.
// ARGV[3]  how many messages to read at most.
// ARGV[4]  the cap on the group's pending messages (0 = no cap).
// ARGV[5]  this take's id.
// ARGV[6]  how long the record (and the priority state) is kept, in ms.
// ARGV[7]  n, when KEYS ends with the priority state; absent: every key after KEYS[1] is a stream, read in order.
// ARGV[8…] each stream's share, in the order of KEYS[2…n+1].
// Returns {state, the entries of KEYS[2], the entries of KEYS[3], …}; state: 1 when the cap stopped the read, 2 when
// the take left nothing undelivered in any of the lane's streams (it drained the lane: its reader need not ask it
// again to learn so), else 0. A lane is drained when each stream gave fewer than asked, or (one stream read) its
// last entry was the last one the take delivered.
// A stream without the group (a lane's first read) gets it here, from its first entry: no command before the take.
// Safe to run twice: the client resends a take whose reply was lost with its connection, and Redis may have run
// it. The messages the first run delivered are this consumer's, yet it never saw them: run again, the take would
// read the next ones, and those would wait for a reclaim (the claim idle time, and one more delivery). So the
// take whose id the record holds answers the messages it delivered, those still pending to this consumer (and
// changes no pass).
export const TAKE_WITHIN_CAP_SCRIPT = defineScript(`
-- Runs a command on stream KEYS[k] of the group; when the group is missing, makes it (if the stream exists) and
-- runs it again. Answers \`absent\` when the stream does not exist.
local function onGroup(k, absent, ...)
  local reply = redis.pcall(...)
  if type(reply) == 'table' and reply.err then
    if not string.find(reply.err, '^NOGROUP') then error(reply) end
    if redis.call('EXISTS', KEYS[k]) == 0 then return absent end
    redis.call('XGROUP', 'CREATE', KEYS[k], ARGV[1], '0')
    return redis.call(...)
  end
  return reply
end
local n = tonumber(ARGV[7]) or (#KEYS - 1)
local last = n + 1
local out = {0}
for k = 2, last do out[k] = {} end
local record = redis.call('GET', KEYS[1])
if record then
  local take, ids = string.match(record, '^(%S+) (.*)$')
  if take == ARGV[5] then
    for at, list in string.gmatch(ids, '(%d+):([^;]+)') do
      local k = tonumber(at)
      for id in string.gmatch(list, '[^,]+') do
        if #redis.call('XPENDING', KEYS[k], ARGV[1], id, id, 1, ARGV[2]) == 1 then
          local entry = redis.call('XRANGE', KEYS[k], id, id)[1]
          if entry then table.insert(out[k], entry) end
        end
      end
    end
    return out
  end
end
local count = tonumber(ARGV[3])
local cap = tonumber(ARGV[4])
-- The streams that exist (acked messages are deleted, and an emptied stream may be too): the usual lane has one.
local present = {}
for k = 2, last do
  if last == 2 or redis.call('EXISTS', KEYS[k]) == 1 then present[#present + 1] = k end
end
-- Reads up to \`want\` new messages of stream k into its answer; answers how many it read.
local taken = {}
local function read(k, want)
  local reply = onGroup(k, false, 'XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', want, 'STREAMS', KEYS[k], '>')
  if not reply then return 0 end
  local entries = reply[1][2]
  taken[k] = taken[k] or {}
  for _, entry in ipairs(entries) do
    table.insert(out[k], entry)
    table.insert(taken[k], entry[1])
  end
  return #entries
end
-- With that many messages of the lane pending (the argument): lowers the count to what the cap leaves, and says (state 1) when it
-- leaves none.
local function capped(pending)
  if cap <= 0 then return false end
  count = math.min(count, cap - pending)
  if count > 0 then return false end
  out[1] = 1
  return true
end
local drained = true
if #present > 1 and ARGV[7] then
  -- The group's pending count and whether stream k holds undelivered messages; the group is made when missing.
  local function info(k)
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[k])) do
      local f = {}
      for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
      if f['name'] == ARGV[1] then
        local lag = f['lag']
        -- An unknown lag (after deletions Redis may not know it) is settled by a look at the next entry.
        if lag == false then
          lag = #redis.call('XRANGE', KEYS[k], '(' .. f['last-delivered-id'], '+', 'COUNT', 1)
        end
        return f['pending'], lag > 0
      end
    end
    redis.call('XGROUP', 'CREATE', KEYS[k], ARGV[1], '0')
    return 0, redis.call('XLEN', KEYS[k]) > 0
  end
  local pending = 0
  local work = {}
  for _, k in ipairs(present) do
    local p, undelivered = info(k)
    pending = pending + p
    if undelivered then work[#work + 1] = k end
  end
  if capped(pending) then return out end
  local state = KEYS[last + 1]
  local saved = redis.call('HGETALL', state)
  local fields = {}
  for i = 1, #saved, 2 do fields[saved[i]] = tonumber(saved[i + 1]) end
  local v = fields['v'] or 0
  local pass, stride = {}, {}
  for _, k in ipairs(work) do
    stride[k] = 1 / math.max(tonumber(ARGV[k + 6]) or 1, 1e-6)
    -- A stream that has had work all along has a pass of at least v; one that had none starts a stride after it.
    local saved = fields[tostring(k)]
    if saved and saved >= v then pass[k] = saved else pass[k] = v + stride[k] end
  end
  while count > 0 and #work > 0 do
    local best, second = 1, nil
    for i = 2, #work do
      local k, b = work[i], work[best]
      if pass[k] < pass[b] or (pass[k] == pass[b] and stride[k] < stride[b]) then best = i end
    end
    for i = 1, #work do
      if i ~= best and (second == nil or pass[work[i]] < second) then second = pass[work[i]] end
    end
    local k = work[best]
    local want = count
    if second then want = math.min(count, math.floor((second - pass[k]) / stride[k]) + 1) end
    v = pass[k]
    local got = read(k, want)
    pass[k] = pass[k] + got * stride[k]
    count = count - got
    if got < want then table.remove(work, best) end
  end
  drained = #work == 0
  local changes = { 'v', v }
  for k, p in pairs(pass) do
    changes[#changes + 1] = k
    changes[#changes + 1] = p
  end
  redis.call('HSET', state, unpack(changes))
  redis.call('PEXPIRE', state, ARGV[6])
else
  if cap > 0 then
    local pending = 0
    for _, k in ipairs(present) do pending = pending + onGroup(k, {0}, 'XPENDING', KEYS[k], ARGV[1])[1] end
    if capped(pending) then return out end
  end
  for _, k in ipairs(present) do
    if count <= 0 then
      drained = false
      break
    end
    local got = read(k, count)
    count = count - got
    if count <= 0 and got > 0 then
      local final = redis.call('XREVRANGE', KEYS[k], '+', '-', 'COUNT', 1)[1]
      if final and final[1] ~= taken[k][#taken[k]] then drained = false end
    end
  end
end
if drained then out[1] = 2 end
local ids = {}
for k = 2, last do
  if taken[k] and #taken[k] > 0 then ids[#ids + 1] = k .. ':' .. table.concat(taken[k], ',') end
end
if #ids > 0 then redis.call('SET', KEYS[1], ARGV[5] .. ' ' .. table.concat(ids, ';'), 'PX', ARGV[6]) end
return out`);
