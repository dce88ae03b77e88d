-- Let a run's place (or its place in line) go and hand free places on, in line order.
-- KEYS: holders (set), line (zset). ARGV: run, cap. Returns the runs handed a place.
local run, cap = ARGV[1], tonumber(ARGV[2])
redis.call('SREM', KEYS[1], run)
redis.call('ZREM', KEYS[2], run)
local handed = {}
while redis.call('SCARD', KEYS[1]) < cap do
  local head = redis.call('ZPOPMIN', KEYS[2])
  if #head == 0 then break end
  redis.call('SADD', KEYS[1], head[1])
  handed[#handed + 1] = head[1]
end
return handed
