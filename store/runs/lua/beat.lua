-- Renew a worker process's liveness record.
-- KEYS: procs. ARGV: process, expires_at_ms, now_ms. Returns 1 if it was still alive.
local before = redis.call('ZSCORE', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
if before and tonumber(before) > tonumber(ARGV[3]) then
  return 1
end
return 0
