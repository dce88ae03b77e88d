-- Take (or renew) a run's lease, and read the run's record in the same call; index the run
-- under the taking owner's process (orphaned.lua finds it there once that process is dead).
-- KEYS: lease, record, the owner's process's lease set (or the lease key again: none).
-- ARGV: owner, now_ms, new expires_at_ms, TTL in ms, run id.
-- Returns {1, record JSON or false} when taken, {0} when another owner holds it.
local lease = redis.call('HMGET', KEYS[1], 'owner', 'expires_at_ms')
if lease[1] and lease[1] ~= ARGV[1] and tonumber(lease[2]) > tonumber(ARGV[2]) then
  return {0}
end
hold_lease(KEYS[1], ARGV[1], ARGV[3], ARGV[4], KEYS[3], ARGV[5])
return {1, redis.call('HGET', KEYS[2], 'record')}
