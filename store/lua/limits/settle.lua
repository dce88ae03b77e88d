-- A call cost more (or fewer) tokens than its estimate: move the token schedule.
-- KEYS: tat:tokens, count:tokens(minute). ARGV: delta tokens, tokens per minute.
local v = redis.call('GET', KEYS[1])
redis.call('INCRBY', KEYS[2], math.floor(tonumber(ARGV[1])))
redis.call('PEXPIRE', KEYS[2], 180000)
if not v then return 0 end
local tat, d = tonumber(v), tonumber(ARGV[1])
local interval = 60000 / tonumber(ARGV[2])
if d >= 0 then
  if now > tat then tat = now end
  tat = tat + d * interval
elseif tat > now then
  tat = math.max(now, tat + d * interval)
else
  return 0
end
redis.call('SET', KEYS[1], string.format('%.3f', tat), 'PX', math.ceil(tat - now) + 3600000)
return 1
