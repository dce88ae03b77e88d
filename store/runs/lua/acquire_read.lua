-- acquire.lua, and when taken the run's snapshot as its snapshot store reads it
-- (store/snapshots/redis.py RedisSnapshotStore._fetch): one round trip opens a turn.
-- KEYS: lease, record, the owner's process's lease set (or the lease key again: none),
--       the run's snapshot hash, its transcript list.
-- ARGV: owner, now_ms, new expires_at_ms, TTL in ms, run id, the transcript index the
--       fragments are read from (0: all of them).
-- Returns {1, record JSON or false, {doc, head, n, size, chain}, {fragments...}} when
-- taken, {0} when another owner holds it.
local lease = redis.call('HMGET', KEYS[1], 'owner', 'expires_at_ms')
if lease[1] and lease[1] ~= ARGV[1] and tonumber(lease[2]) > tonumber(ARGV[2]) then
  return {0}
end
hold_lease(KEYS[1], ARGV[1], ARGV[3], ARGV[4], KEYS[3], ARGV[5])
local fields = redis.call('HMGET', KEYS[4], 'doc', 'head', 'n', 'size', 'chain')
return {1, redis.call('HGET', KEYS[2], 'record'), fields, redis.call('LRANGE', KEYS[5], ARGV[6], -1)}
