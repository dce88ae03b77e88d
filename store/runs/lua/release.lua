-- Give a lease up if its owner holds it.
-- KEYS: lease, the owner's process's lease set (or the lease key again: none).
-- ARGV: owner, run id. The run leaves the owner's set even when another owner took the
-- lease since (that owner's claim indexed it under its own process).
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('DEL', KEYS[1])
end
if KEYS[2] ~= KEYS[1] then
  redis.call('SREM', KEYS[2], ARGV[2])
end
return nil
