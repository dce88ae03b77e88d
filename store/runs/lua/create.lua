-- Create a run: its record and first event, and the run in every index.
-- KEYS: record, events, by_created, status set of the new status, due, finished.
-- ARGV: run id, record JSON, last seq, status, created_at_ms, due_at_ms or "",
--       first event's seq, first event JSON, finished-at ms or "".
-- Returns nil when created, else the existing run's last seq.
local found = redis.call('HGET', KEYS[1], 'last_seq')
if found then
  return found
end
-- An event log without a record is debris of a removed run; the id starts afresh.
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[1], 'record', ARGV[2], 'last_seq', ARGV[3], 'status', ARGV[4],
  'due', ARGV[6], 'next', ARGV[6], 'fin', ARGV[9])
redis.call('RPUSH', KEYS[2], ARGV[8])
redis.call('ZADD', KEYS[3], ARGV[5], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[5], ARGV[1])
if ARGV[6] == '' then
  redis.call('ZREM', KEYS[5], ARGV[1])
else
  redis.call('ZADD', KEYS[5], ARGV[6], ARGV[1])
end
if ARGV[9] == '' then
  redis.call('ZREM', KEYS[6], ARGV[1])
else
  redis.call('ZADD', KEYS[6], ARGV[9], ARGV[1])
end
return nil
