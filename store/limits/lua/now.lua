-- Prepended to every limit script that reads the time: `now`, the server's clock in ms.
-- The Redis clock is the one every worker and host shares.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
