-- Save a run's snapshot as a head plus its transcript's new fragments, compare-and-set on
-- its seq and, for an append, on the stored transcript's length and hash chain.
-- KEYS[1] the run's snapshot hash, KEYS[2] the index set, KEYS[3] the transcript list.
-- ARGV: [1] expected seq ("" for none), [2] new seq, [3] head, [4] run id,
--       [5] "append" or "replace", [6] base length, [7] base chain,
--       [8] new length, [9] new size, [10] new chain, [11..] the fragments to push.
-- Returns nil when written, {'stale', found seq or ""}, or {'moved'} when the seq
-- matches but the stored transcript is not the base this append was planned on.
-- (store/runs/lua/append.lua does the same inside a transition.)
local stored = redis.call('HMGET', KEYS[1], 'seq', 'n', 'chain')
local found = stored[1] or ''
if found ~= ARGV[1] then
  return {'stale', found}
end
if ARGV[5] == 'append' then
  -- The tip stands for the list (append.lua says why): no LLEN.
  if stored[2] ~= ARGV[6] or stored[3] ~= ARGV[7] then
    return {'moved'}
  end
else
  -- A stored tip that matched proves the parts layout, so only a replace may find a whole doc.
  redis.call('DEL', KEYS[3])
  redis.call('HDEL', KEYS[1], 'doc')
end
for i = 11, #ARGV, 1000 do
  redis.call('RPUSH', KEYS[3], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
redis.call('HSET', KEYS[1], 'seq', ARGV[2], 'head', ARGV[3], 'n', ARGV[8], 'size', ARGV[9],
  'chain', ARGV[10])
if found == '' then
  redis.call('SADD', KEYS[2], ARGV[4])
end
return nil
