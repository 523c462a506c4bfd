import { defineScript } from "../redis/script.ts";

// LANE_BACKLOG: what each of some lanes holds, over all its streams, in one command (the backlog's walk,
// `backlog.ts`, runs it for the lanes with work: on one server for up to 64 lanes a call, on a cluster for one,
// whose streams share a slot).
// KEYS[1…] the lanes' streams, lane after lane (a lane's share its hash tag; on one server the lanes' tags differ,
//          which only a cluster forbids).
// ARGV[1]  the group. ARGV[2…] how many streams each lane has, in the order of KEYS.
// Returns, per lane, {waiting, depth, oldest} in one flat list: the entries not yet delivered to the group, the
// entries in the streams (waiting or delivered and not yet acknowledged), and when the oldest waiting one was
// accepted, in ms since the epoch (its `accepted_ms` field when it has one, as a requeued message keeps its first
// time there, else its id's time; 0 when none waits). Acked entries are deleted (XDEL), so a stream's waiting
// entries are its length less its group's pending count, and they are the ones after the group's last delivered
// id; a stream without the group (never read) holds only waiting entries.
// Reads only: safe to run twice.
export const LANE_BACKLOG_SCRIPT = defineScript(`
-- One lane's figures, over its streams KEYS[from] … KEYS[to].
local function lane(from, to)
  local waiting, depth, oldest = 0, 0, 0
  for k = from, to do
    local length = redis.call('XLEN', KEYS[k])
    if length > 0 then
      depth = depth + length
      local pending, after = 0, '-'
      local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[k])
      if ok then
        for _, g in ipairs(groups) do
          local f = {}
          for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
          if f['name'] == ARGV[1] then
            pending = f['pending']
            after = '(' .. f['last-delivered-id']
          end
        end
      end
      if length > pending then
        waiting = waiting + length - pending
        local first = redis.call('XRANGE', KEYS[k], after, '+', 'COUNT', 1)[1]
        if first then
          local at = tonumber(string.match(first[1], '^(%d+)'))
          local fields = first[2]
          for i = 1, #fields, 2 do
            if fields[i] == 'accepted_ms' then at = tonumber(fields[i + 1]) or at end
          end
          if at and (oldest == 0 or at < oldest) then oldest = at end
        end
      end
    end
  end
  return waiting, depth, oldest
end
local out = {}
local at = 1
for a = 2, #ARGV do
  local count = tonumber(ARGV[a])
  local waiting, depth, oldest = lane(at, at + count - 1)
  at = at + count
  out[#out + 1] = waiting
  out[#out + 1] = depth
  out[#out + 1] = oldest
end
return out`);
