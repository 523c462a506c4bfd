import { defineScript } from "../redis/script.ts";

// TAKE_WITHIN_CAP: reads new messages of a lane for a consumer, from its streams in the lane's order (the first
// stream first, the next for what the first did not have), but never more than leave `cap` pending in the group
// across all the lane's streams and all consumers: a tenant's in-flight cap, checked and taken in one step.
// KEYS[1]  the consumer's take record in the lane (takeRecordKey): the last take's id and the entries it
//          delivered, stream by stream as `<index of the stream in KEYS>:<id>,<id>…;…` (one number per stream, not per
//          entry: this script's cost is most of a worker's Redis time on a busy lane).
// KEYS[2…] the lane's streams, in read order (one slot: they share the lane's hash tag).
// ARGV[1]  the group.
// ARGV[2]  the consumer.
// ARGV[3]  how many messages to read at most.
// ARGV[4]  the cap on the group's pending messages (0 = no cap).
// ARGV[5]  this take's id.
// ARGV[6]  how long the record is kept, in ms.
// Returns {state, the entries of KEYS[2], the entries of KEYS[3], …}; state: 1 when the cap stopped the read, 2 when
// the take left nothing undelivered in any of the lane's streams (it drained the lane: its reader need not ask it
// again to learn so), else 0. A lane is drained when each stream gave fewer than asked, or its last entry was the
// last one the take delivered.
// A stream without the group (a lane's first read) gets it here, from its first entry: no command before the take.
// Safe to run twice: the client resends a take whose reply was lost with its connection, and Redis may have run
// it. The messages the first run delivered are this consumer's, yet it never saw them: run again, the take would
// read the next ones, and those would wait for a reclaim (the claim idle time, and one more delivery). So the
// take whose id the record holds answers the messages it delivered, those still pending to this consumer.
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
local out = {0}
for k = 2, #KEYS do out[k] = {} end
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
if cap > 0 then
  local pending = 0
  for k = 2, #KEYS do pending = pending + onGroup(k, {0}, 'XPENDING', KEYS[k], ARGV[1])[1] end
  count = math.min(count, cap - pending)
  if count <= 0 then
    out[1] = 1
    return out
  end
end
local ids = {}
local drained = true
for k = 2, #KEYS do
  if count <= 0 then
    drained = false
    break
  end
  local reply = onGroup(k, false, 'XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', count, 'STREAMS', KEYS[k], '>')
  if reply then
    local entries = reply[1][2]
    out[k] = entries
    local these = {}
    for i, entry in ipairs(entries) do these[i] = entry[1] end
    ids[#ids + 1] = k .. ':' .. table.concat(these, ',')
    count = count - #entries
    if count <= 0 then
      local last = redis.call('XREVRANGE', KEYS[k], '+', '-', 'COUNT', 1)[1]
      if last and last[1] ~= these[#these] then drained = false end
    end
  end
end
if drained then out[1] = 2 end
if #ids > 0 then redis.call('SET', KEYS[1], ARGV[5] .. ' ' .. table.concat(ids, ';'), 'PX', ARGV[6]) end
return out`);
