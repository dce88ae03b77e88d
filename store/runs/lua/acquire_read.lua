-- acquire.lua, and when taken the run's snapshot as its snapshot store reads it
-- (store/snapshots/redis.py RedisSnapshotStore._fetch): one round trip opens a turn.
-- KEYS: lease, record, the owner's process's lease set (or the lease key again: none),
--       the run's snapshot hash, its transcript list.
-- ARGV: owner, now_ms, new expires_at_ms, TTL in ms, run id, the transcript index the
--       fragments are read from (0: all of them), and a seq at which the caller needs no
--       snapshot (it remembers the state there; "": none).
-- Returns {1, record JSON or false, {doc, head, n, size, chain}, {fragments...}} when
-- taken ({1, record JSON} when the run's log ends at that seq), {0} when another owner
-- holds it.
local lease = redis.call('HMGET', KEYS[1], 'owner', 'expires_at_ms')
if lease[1] and lease[1] ~= ARGV[1] and tonumber(lease[2]) > tonumber(ARGV[2]) then
  return {0}
end
hold_lease(KEYS[1], ARGV[1], ARGV[3], ARGV[4], KEYS[3], ARGV[5])
local record = redis.call('HMGET', KEYS[2], 'record', 'last_seq')
if ARGV[7] ~= '' and record[2] == ARGV[7] then
  return {1, record[1]}
end
local fields = redis.call('HMGET', KEYS[4], 'doc', 'head', 'n', 'size', 'chain')
return {1, record[1], fields, redis.call('LRANGE', KEYS[5], ARGV[6], -1)}
