-- Move a live run's due time if it is still at the seq the sweeper saw.
-- KEYS: record, due. ARGV: run id, seen seq, due_at_ms. Returns 1 if moved. The index moves,
-- and with it the record's 'due' field (the due time the index holds, which append.lua
-- compares against) and 'next' (the exact due time overdue() checks: left behind, a due
-- time moved earlier would be skipped until the old one came); the record's JSON keeps
-- the due time its last append gave it.
if redis.call('HGET', KEYS[1], 'last_seq') ~= ARGV[2] then
  return 0
end
if not redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  return 0
end
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
redis.call('HSET', KEYS[1], 'due', ARGV[3], 'next', ARGV[3])
return 1
