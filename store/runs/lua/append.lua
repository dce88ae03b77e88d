-- One transition: append events and replace the record, fenced by the last seq and the
-- lease; when asked, save the run's snapshot in the same step (compare-and-set on its seq
-- and transcript) and let the lease go. Nothing is written unless every fence holds.
--
-- KEYS: [1] record, [2] events, [3] lease, [4] status set of the new status, [5] due,
--       [6] finished, [7] snapshot hash, [8] snapshot index, [9] transcript,
--       [10] the owner's process's lease set (or the lease key again: none).
-- ARGV: [1] run id, [2] record JSON, [3] last seq, [4] status, [5] created_at_ms,
--       [6] due_at_ms or "", [7] expected last seq, [8] "1" if fenced by the lease,
--       [9] owner, [10] now_ms, [11] status-set key prefix, [12] finished-at ms or "",
--       [13] "1" to release the lease, [14] snapshot: "" (none), "append" or "replace",
--       [15] expected snapshot seq ("" for none), [16] head, [17] base length,
--       [18] base chain, [19] new length, [20] new size, [21] new chain,
--       [22] how many events, then the events, then the transcript fragments to push.
-- Returns nil when written, {'stale', found seq or ''}, {'lease'},
-- {'snapshot', found snapshot seq or ''} or {'moved'} (the snapshot's seq matches but its
-- transcript is not the base this save was planned on).
--
-- The indexes change only with what they index: the status sets when the status changes,
-- the finished set when the run finishes or leaves a finished status ('fin', written
-- since; a record without it may be in the set), the due set when the due time moves
-- earlier, to none, or later by more than DUE_SLACK. The record keeps the exact due time
-- in 'next' and the index's in 'due': the index may say a run is due up to DUE_SLACK
-- early, never late, and the sweeper checks 'next' (redis.py). The old status's set is
-- named from ARGV[11]: it is only known once the record is read (single node; see redis.py).
local rec = redis.call('HMGET', KEYS[1], 'last_seq', 'status', 'due', 'fin')
if rec[1] ~= ARGV[7] then
  return {'stale', rec[1] or ''}
end
if ARGV[8] == '1' then
  local lease = redis.call('HMGET', KEYS[3], 'owner', 'expires_at_ms')
  if lease[1] ~= ARGV[9] or tonumber(lease[2]) <= tonumber(ARGV[10]) then
    return {'lease'}
  end
end
local DUE_SLACK = 1000
local mode = ARGV[14]
local stored_seq = ''
if mode ~= '' then
  stored_seq = redis.call('HGET', KEYS[7], 'seq') or ''
  if stored_seq ~= ARGV[15] then
    return {'snapshot', stored_seq}
  end
  if mode == 'append' then
    local tip = redis.call('HMGET', KEYS[7], 'n', 'chain')
    if tip[1] ~= ARGV[17] or tip[2] ~= ARGV[18]
        or redis.call('LLEN', KEYS[9]) ~= tonumber(ARGV[17]) then
      return {'moved'}
    end
  end
end

-- Push ARGV[first..last] onto a list, a bounded number per call (Lua's stack is finite).
local function push(key, first, last)
  for i = first, last, 1000 do
    redis.call('RPUSH', key, unpack(ARGV, i, math.min(i + 999, last)))
  end
end

-- The fence above makes the log contiguous, so an event's index is its seq - 1
-- (a list costs a few bytes an entry; a sorted set costs about a hundred).
local events_end = 22 + tonumber(ARGV[22])
push(KEYS[2], 23, events_end)
-- The due index: kept while it is at most DUE_SLACK ms early (and at most half the time
-- left until the new due time: a run due in a minute is not looked at a half-minute early).
local indexed = rec[3] or ''
local due = ARGV[6]
if due == '' then
  if indexed ~= '' then
    redis.call('ZREM', KEYS[5], ARGV[1])
  end
  indexed = ''
else
  local new, old = tonumber(due), tonumber(indexed)
  local slack = math.min(DUE_SLACK, (new - tonumber(ARGV[10])) / 2)
  if old == nil or new < old or new > old + slack then
    redis.call('ZADD', KEYS[5], due, ARGV[1])
    indexed = due
  end
end
redis.call('HSET', KEYS[1], 'record', ARGV[2], 'last_seq', ARGV[3], 'status', ARGV[4],
  'due', indexed, 'next', due, 'fin', ARGV[12])
if rec[2] ~= ARGV[4] then
  if rec[2] then
    redis.call('ZREM', ARGV[11] .. rec[2], ARGV[1])
  end
  redis.call('ZADD', KEYS[4], ARGV[5], ARGV[1])
end
if ARGV[12] ~= '' then
  redis.call('ZADD', KEYS[6], ARGV[12], ARGV[1])
elseif rec[2] ~= ARGV[4] and rec[4] ~= '' then
  redis.call('ZREM', KEYS[6], ARGV[1])
end

if mode ~= '' then
  if mode == 'replace' then
    redis.call('DEL', KEYS[9])
    redis.call('HDEL', KEYS[7], 'doc')
  end
  push(KEYS[9], events_end + 1, #ARGV)
  redis.call('HSET', KEYS[7], 'seq', ARGV[3], 'head', ARGV[16], 'n', ARGV[19], 'size', ARGV[20],
    'chain', ARGV[21])
  if stored_seq == '' then
    redis.call('SADD', KEYS[8], ARGV[1])
  end
end
if ARGV[13] == '1' and (ARGV[8] == '1' or redis.call('HGET', KEYS[3], 'owner') == ARGV[9]) then
  redis.call('DEL', KEYS[3])
end
-- As release.lua: the released run leaves the owner's process's lease set (orphaned.lua).
if ARGV[13] == '1' and KEYS[10] ~= KEYS[3] then
  redis.call('SREM', KEYS[10], ARGV[1])
end
return nil
