-- Extend the leases of long-running requests of one tenant.
-- KEYS[1] leases zset; ARGV[1] lease_ttl_ms, ARGV[2..] lease ids.
-- Only leases still present are extended (an expired one stays gone). Returns how many were renewed.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local ttl_ms = tonumber(ARGV[1])
local renewed = 0
for i = 2, #ARGV do
  renewed = renewed + redis.call('ZADD', KEYS[1], 'XX', 'CH', now + ttl_ms * 1000, ARGV[i])
end
if renewed > 0 and redis.call('PTTL', KEYS[1]) < ttl_ms + 1000 then
  redis.call('PEXPIRE', KEYS[1], ttl_ms + 1000)
end
return renewed
