-- Take (or renew) a run's lease as acquire.lua does, and also from a holder whose process
-- is dead (its liveness record in procs expired): a compare-and-set on that dead owner.
-- KEYS: lease, procs, the claiming owner's process's lease set (or the lease key again).
-- ARGV: owner, now_ms, new expires_at_ms, TTL in ms, run id, process-set key prefix.
-- Returns {1, owner taken from or ''} or {0, holder, holder's liveness expiry or ''}.
local lease = redis.call('HMGET', KEYS[1], 'owner', 'expires_at_ms')
local took = ''
if lease[1] and lease[1] ~= ARGV[1] and tonumber(lease[2]) > tonumber(ARGV[2]) then
  local holder = owner_process(lease[1])
  local alive = holder and redis.call('ZSCORE', KEYS[2], holder)
  if not alive or tonumber(alive) > tonumber(ARGV[2]) then
    return {0, lease[1], alive or ''}
  end
  took = lease[1]
  redis.call('SREM', ARGV[6] .. holder .. ':leases', ARGV[5])
end
hold_lease(KEYS[1], ARGV[1], ARGV[3], ARGV[4], KEYS[3], ARGV[5])
return {1, took}
