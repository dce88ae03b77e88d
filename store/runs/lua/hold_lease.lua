-- Hold a run's lease for an owner until expires_at_ms (its key outlives that by ttl_ms), and
-- index the run in the owner's process's lease set (orphaned.lua finds it there once that
-- process is dead); process_set equal to the lease key: no process to index it under.
-- Prepended to the scripts that take a lease (acquire.lua, claim.lua).
local function hold_lease(lease, owner, expires_at_ms, ttl_ms, process_set, run_id)
  redis.call('HSET', lease, 'owner', owner, 'expires_at_ms', expires_at_ms)
  redis.call('PEXPIRE', lease, ttl_ms)
  if process_set ~= lease then
    redis.call('SADD', process_set, run_id)
  end
end
