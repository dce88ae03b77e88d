-- KEYS: finished, by_created, due. ARGV: before_ms, limit, run-key prefix ("<prefix>:run:{"),
-- status-set key prefix. Deletes the oldest finished runs updated before before_ms; their ids.
-- The finished index holds only runs whose status is finished (append keeps it so), and
-- every index the run is in is cleaned with its keys: nothing dangles.
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1], 'LIMIT', 0, ARGV[2])
for _, id in ipairs(ids) do
  local base = ARGV[3] .. id .. '}:'
  local status = redis.call('HGET', base .. 'record', 'status')
  if status then
    redis.call('ZREM', ARGV[4] .. status, id)
  end
  redis.call('UNLINK', base .. 'record', base .. 'events', base .. 'lease')
  redis.call('ZREM', KEYS[1], id)
  redis.call('ZREM', KEYS[2], id)
  redis.call('ZREM', KEYS[3], id)
end
return ids
