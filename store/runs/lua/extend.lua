-- Extend a lease its owner still holds. KEYS: lease. ARGV: owner, new expires_at_ms, TTL in ms.
-- Returns 1 if extended. Only the holder's key is touched: a lease released (key gone) or
-- taken stays so.
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'expires_at_ms', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
