-- Runs held by dead processes. KEYS: procs. ARGV: now_ms, limit, process-set key prefix,
-- run-key prefix ("<prefix>:run:{").
-- Walks the dead processes (liveness expired) and the leases each claimed: returns
-- {run id, owner, ...} for each unexpired lease one still holds; drops set members it no
-- longer holds, and forgets a dead process that holds nothing.
local found = {}
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, 100)
for _, process in ipairs(dead) do
  local held_key = ARGV[3] .. process .. ':leases'
  local holding = 0
  for _, id in ipairs(redis.call('SMEMBERS', held_key)) do
    local lease = redis.call('HMGET', ARGV[4] .. id .. '}:lease', 'owner', 'expires_at_ms')
    if lease[1] and owner_process(lease[1]) == process
        and tonumber(lease[2]) > tonumber(ARGV[1]) then
      holding = holding + 1
      if #found < 2 * tonumber(ARGV[2]) then
        table.insert(found, id)
        table.insert(found, lease[1])
      end
    else
      redis.call('SREM', held_key, id)
    end
  end
  if holding == 0 then
    redis.call('ZREM', KEYS[1], process)
    redis.call('DEL', held_key)
  end
end
return found
