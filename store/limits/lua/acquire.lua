-- Take (or keep) a place under a concurrency cap, else join its line in order.
-- KEYS: holders (set), line (zset). ARGV: run, cap.
-- Returns {1, 0} when held, else {0, runs ahead, holders...}.
local run, cap = ARGV[1], tonumber(ARGV[2])
if redis.call('SISMEMBER', KEYS[1], run) == 1 then return {1, 0} end
redis.call('ZADD', KEYS[2], 'NX', now, run)
local place = redis.call('ZRANK', KEYS[2], run)
local free = cap - redis.call('SCARD', KEYS[1])
if place < free then
  redis.call('ZREM', KEYS[2], run)
  redis.call('SADD', KEYS[1], run)
  return {1, 0}
end
if free < 0 then free = 0 end
local out = {0, place - free}
for _, holder in ipairs(redis.call('SRANDMEMBER', KEYS[1], 50)) do out[#out + 1] = holder end
return out
