-- Move a run's snapshot aside, whatever its state.
-- KEYS[1] the run's snapshot hash, KEYS[2] the transcript list, KEYS[3] and KEYS[4] their
-- quarantined names, KEYS[5] the index set. ARGV: run id. Returns 1 when moved, 0 if none.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
redis.call('RENAME', KEYS[1], KEYS[3])
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('RENAME', KEYS[2], KEYS[4])
end
redis.call('SREM', KEYS[5], ARGV[1])
return 1
