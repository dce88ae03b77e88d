-- One transition: append events and replace the record, fenced by the last seq and the
-- lease; when asked, save the run's snapshot in the same step (compare-and-set on its seq
-- and transcript) and let the lease go. Nothing is written unless every fence holds.
--
-- KEYS: [1] record, [2] events, [3] lease, [4] status set of the new status, [5] due,
--       [6] finished, [7] snapshot hash, [8] snapshot index, [9] transcript,
--       [10] the owner's process's lease set (or the lease key again: none).
-- ARGV: [1] the scalars below, separated by one space (none holds a space: a run id, a
--       status, a key prefix, numbers and hex chains; "" is an empty field), [2] record
--       JSON, [3] owner, [4] snapshot: "" (none), "append" or "replace" (save it), or
--       "drop" (delete it: the run finished), [5] head, [6] the record JSON the run must
--       still have ("" for any: a caller that remembers the record it wrote at the
--       expected seq makes sure no other run has since had this id), then
--       the events, then the transcript fragments to push, then (with an outbox) the
--       message to push onto the outbox list. One argument for the
--       scalars, not one each: redis-py encodes and frames every argument in Python.
-- Scalars: run id, last seq, status, created_at_ms, due_at_ms or "", expected last seq,
--       "1" if fenced by the lease, now_ms, status-set key prefix, finished-at ms or "",
--       "1" to release the lease, expected snapshot seq ("" for none), base length,
--       base chain, new length, new size, new chain, how many events, then the outbox's
--       database, its list (no space in either) and this store's database, or "" each.
-- Returns nil when written, {'stale', found seq or ''}, {'record'} (at the expected seq but
-- not the record the caller remembers), {'lease'},
-- {'snapshot', found snapshot seq or ''} or {'moved'} (the snapshot's seq matches but its
-- transcript is not the base this save was planned on).
--
-- The indexes change only with what they index: the status sets when the status changes,
-- the finished set when the run finishes or leaves a finished status ('fin', written
-- since; a record without it may be in the set), the due set when the due time moves
-- earlier, to none, or later by more than DUE_SLACK. The record keeps the exact due time
-- in 'next' and the index's in 'due': the index may say a run is due up to DUE_SLACK
-- early, never late, and the sweeper checks 'next' (redis.py). The old status's set is
-- named from the status-set key prefix: it is only known once the record is read (single
-- node; see redis.py).
local f = {}
for field in (ARGV[1] .. ' '):gmatch('(.-) ') do
  f[#f + 1] = field
end
local run_id, last_seq, status, created_at, due, expected = f[1], f[2], f[3], f[4], f[5], f[6]
local fenced, now_ms, status_prefix, finished_at, release = f[7], f[8], f[9], f[10], f[11]
local snapshot_seq, base_length, base_chain = f[12], f[13], f[14]
local new_length, new_size, new_chain, event_count = f[15], f[16], f[17], tonumber(f[18])
local record, owner, mode, head, was = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local outbox_db, outbox_key, own_db = f[19], f[20], f[21]

local rec = redis.call('HMGET', KEYS[1], 'last_seq', 'status', 'due', 'fin')
if rec[1] ~= expected then
  return {'stale', rec[1] or ''}
end
if was ~= '' and redis.call('HGET', KEYS[1], 'record') ~= was then
  return {'record'}
end
if fenced == '1' then
  local lease = redis.call('HMGET', KEYS[3], 'owner', 'expires_at_ms')
  if lease[1] ~= owner or tonumber(lease[2]) <= tonumber(now_ms) then
    return {'lease'}
  end
end
local DUE_SLACK = 1000
local stored_seq = ''
local saves = mode == 'append' or mode == 'replace'
if saves then
  local stored = redis.call('HMGET', KEYS[7], 'seq', 'n', 'chain')
  stored_seq = stored[1] or ''
  if stored_seq ~= snapshot_seq then
    return {'snapshot', stored_seq}
  end
  -- The stored tip stands for the transcript list: only a script that sets 'n' and
  -- 'chain' pushes to it, and the list goes (DEL, RENAME) only with the hash, so no LLEN.
  if mode == 'append' and (stored[2] ~= base_length or stored[3] ~= base_chain) then
    return {'moved'}
  end
end

-- The outbox first, before any other write: should Redis refuse it (a key of another type
-- in its place), the script stops with nothing written. SELECT in a script selects for the
-- script only (Redis 2.8.12 and later): the caller's connection keeps its database.
local fragments_end = #ARGV
if outbox_key ~= nil and outbox_key ~= '' then
  fragments_end = #ARGV - 1
  if outbox_db ~= own_db then
    redis.call('SELECT', outbox_db)
  end
  redis.call('LPUSH', outbox_key, ARGV[#ARGV])
  if outbox_db ~= own_db then
    redis.call('SELECT', own_db)
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
local events_end = 6 + event_count
push(KEYS[2], 7, events_end)
-- The due index: kept while it is at most DUE_SLACK ms early (and at most half the time
-- left until the new due time: a run due in a minute is not looked at a half-minute early).
local indexed = rec[3] or ''
if due == '' then
  if indexed ~= '' then
    redis.call('ZREM', KEYS[5], run_id)
  end
  indexed = ''
else
  local new, old = tonumber(due), tonumber(indexed)
  local slack = math.min(DUE_SLACK, (new - tonumber(now_ms)) / 2)
  if old == nil or new < old or new > old + slack then
    redis.call('ZADD', KEYS[5], due, run_id)
    indexed = due
  end
end
redis.call('HSET', KEYS[1], 'record', record, 'last_seq', last_seq, 'status', status,
  'due', indexed, 'next', due, 'fin', finished_at)
if rec[2] ~= status then
  if rec[2] then
    redis.call('ZREM', status_prefix .. rec[2], run_id)
  end
  redis.call('ZADD', KEYS[4], created_at, run_id)
end
if finished_at ~= '' then
  redis.call('ZADD', KEYS[6], finished_at, run_id)
elseif rec[2] ~= status and rec[4] ~= '' then
  redis.call('ZREM', KEYS[6], run_id)
end

if mode == 'drop' then
  redis.call('DEL', KEYS[7], KEYS[9])
  redis.call('SREM', KEYS[8], run_id)
elseif saves then
  if mode == 'replace' then
    redis.call('DEL', KEYS[9])
    redis.call('HDEL', KEYS[7], 'doc')
  end
  push(KEYS[9], events_end + 1, fragments_end)
  redis.call('HSET', KEYS[7], 'seq', last_seq, 'head', head, 'n', new_length, 'size', new_size,
    'chain', new_chain)
  if stored_seq == '' then
    redis.call('SADD', KEYS[8], run_id)
  end
end
if release == '1' and (fenced == '1' or redis.call('HGET', KEYS[3], 'owner') == owner) then
  redis.call('DEL', KEYS[3])
end
-- As release.lua: the released run leaves the owner's process's lease set (orphaned.lua).
if release == '1' and KEYS[10] ~= KEYS[3] then
  redis.call('SREM', KEYS[10], run_id)
end
return nil
