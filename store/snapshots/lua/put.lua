-- Replace a run's snapshot by a whole document, compare-and-set on its seq.
-- KEYS[1] the run's snapshot hash, KEYS[2] the index set, KEYS[3] the transcript list.
-- ARGV: expected seq ("" for none stored), new seq, document, run id.
-- Returns nil when written, else {found seq or ""}.
-- The index set is in another slot than the run's hash: on Redis Cluster the
-- SADD would move out of the script into a second call (list() only reads it).
local found = redis.call('HGET', KEYS[1], 'seq') or ''
if found ~= ARGV[1] then
  return {found}
end
redis.call('DEL', KEYS[3])
redis.call('HDEL', KEYS[1], 'head', 'n', 'size', 'chain')
redis.call('HSET', KEYS[1], 'seq', ARGV[2], 'doc', ARGV[3])
if found == '' then
  redis.call('SADD', KEYS[2], ARGV[4])
end
return nil
