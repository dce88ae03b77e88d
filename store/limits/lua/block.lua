-- A 429 with Retry-After: nobody of the key calls before now + ARGV[1] ms. KEYS: blocked.
local until_ms = now + tonumber(ARGV[1])
local was = tonumber(redis.call('GET', KEYS[1]) or '0')
if until_ms > was then
  redis.call('SET', KEYS[1], string.format('%.3f', until_ms), 'PX', math.ceil(tonumber(ARGV[1])) + 1000)
end
return 1
