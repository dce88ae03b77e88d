-- Give a lease up if its owner holds it. KEYS: lease. ARGV: owner.
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('DEL', KEYS[1])
end
return nil
