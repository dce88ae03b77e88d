-- A call cost more (or fewer) tokens than its estimate: move the token schedule, and the
-- tokens that went (both TATs, as LocalLimitStore.settle does).
-- KEYS: tat:tokens, count:tokens(minute), sent:tokens. ARGV: delta tokens, tokens per minute.
redis.call('INCRBY', KEYS[2], math.floor(tonumber(ARGV[1])))
redis.call('PEXPIRE', KEYS[2], 180000)
local d = tonumber(ARGV[1])
local interval = 60000 / tonumber(ARGV[2])
local moved = 0
for _, key in ipairs({KEYS[1], KEYS[3]}) do
  local v = redis.call('GET', key)
  if v then
    local tat = tonumber(v)
    local changed = true
    if d >= 0 then
      if now > tat then tat = now end
      tat = tat + d * interval
    elseif tat > now then
      tat = math.max(now, tat + d * interval)
    else
      changed = false
    end
    if changed then
      redis.call('SET', key, string.format('%.3f', tat), 'PX', math.ceil(tat - now) + 3600000)
      moved = 1
    end
  end
end
return moved
