-- May a run call the model now? (LimitStore.admit; runtime.limits does the same sums.)
-- KEYS: tat:requests, tat:tokens, blocked, reservation(seq), reservation(next seq),
--       line:under_way, line:new, count:requests(minute), count:tokens(minute),
--       sent:requests, sent:tokens
-- ARGV: rpm, tpm, burst_ms, cost requests, cost tokens, horizon_ms, line (0 under way, 1 new),
--       run, keep_ms, early_ms
-- Returns {outcome, wait_ms, binding, now, place in line}.
-- Two TATs a rate: tat: the schedule, sent: the calls that went (what the provider sees).
local per_minute = {tonumber(ARGV[1]), tonumber(ARGV[2])}
local tau = tonumber(ARGV[3])
local costs = {tonumber(ARGV[4]), tonumber(ARGV[5])}
local keep = tonumber(ARGV[9])
local early = tonumber(ARGV[10])
local units = {'requests', 'tokens'}
local sent = {}
local room = now
for i = 1, 2 do
  if per_minute[i] > 0 then
    local v = redis.call('GET', KEYS[9 + i])
    if v then
      sent[i] = tonumber(v)
      if sent[i] - tau > room then room = sent[i] - tau end
    end
  end
end
local function went()
  for i = 1, 2 do
    if per_minute[i] > 0 then
      local base = sent[i] or now
      if now > base then base = now end
      local tat = base + costs[i] * 60000 / per_minute[i]
      redis.call('SET', KEYS[9 + i], string.format('%.3f', tat), 'PX', math.ceil(tat - now + tau) + keep)
    end
  end
end
local res = redis.call('GET', KEYS[4])
if res then
  local at = tonumber(res)
  -- A reservation come late waits for room behind the calls that went, not go in a bunch.
  if at - now <= early then at = room end
  if at - now <= early then
    redis.call('DEL', KEYS[4])
    went()
    return {'go', '0', 'reserved', tostring(now), '0'}
  end
  redis.call('SET', KEYS[4], string.format('%.3f', at), 'PX', math.ceil(at - now) + keep)
  return {'reserved', tostring(at - now), 'early', tostring(now), '0'}
end
local go, binding = now, ''
local blocked = tonumber(redis.call('GET', KEYS[3]) or '0')
if blocked > go then go = blocked; binding = 'blocked' end
local tats = {}
for i = 1, 2 do
  if per_minute[i] > 0 then
    local v = redis.call('GET', KEYS[i])
    if v then tats[i] = tonumber(v) end
    if sent[i] and (not tats[i] or sent[i] > tats[i]) then tats[i] = sent[i] end
    if tats[i] and tats[i] - tau > go then go = tats[i] - tau; binding = units[i] end
  end
end
local wait = go - now
local run = ARGV[8]
local mine = KEYS[6 + tonumber(ARGV[7])]
redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now - keep)
redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', now - keep)
if wait > tonumber(ARGV[6]) then
  redis.call('ZADD', mine, 'NX', now, run)
  redis.call('PEXPIRE', mine, keep)
  local place = redis.call('ZRANK', mine, run)
  if tonumber(ARGV[7]) == 1 then place = place + redis.call('ZCARD', KEYS[6]) end
  return {'denied', tostring(wait), binding, tostring(now), tostring(place)}
end
for i = 1, 2 do
  if per_minute[i] > 0 then
    local base = tats[i] or go
    if go > base then base = go end
    local tat = base + costs[i] * 60000 / per_minute[i]
    redis.call('SET', KEYS[i], string.format('%.3f', tat), 'PX', math.ceil(tat - now + tau) + keep)
  end
end
redis.call('ZREM', KEYS[6], run)
redis.call('ZREM', KEYS[7], run)
redis.call('INCRBY', KEYS[8], 1)
redis.call('PEXPIRE', KEYS[8], 180000)
if per_minute[2] > 0 then
  redis.call('INCRBY', KEYS[9], math.floor(costs[2]))
  redis.call('PEXPIRE', KEYS[9], 180000)
end
if wait > 0 then
  redis.call('SET', KEYS[5], string.format('%.3f', go), 'PX', keep)
  return {'reserved', tostring(wait), binding, tostring(now), '0'}
end
went()
return {'go', '0', binding, tostring(now), '0'}
