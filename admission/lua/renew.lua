-- Extend the leases of long-running requests of one tenant.
-- KEYS[1] leases zset, KEYS[2] config hash; ARGV[1] lease_ttl_ms, ARGV[2] default max_concurrent, ARGV[3..] lease ids.
-- A lease still held is extended. One that expired (an outage outlasted its TTL, or Redis lost it) is taken
-- again while the tenant is below max_concurrent, else reported lost: the limit is never exceeded.
-- Returns {renewed, {re-taken lease ids}, {lost lease ids}}.
local function limit(v, default)
  local n = tonumber(v)
  if n == nil or n ~= n or n < 0 or n == math.huge then n = tonumber(default) end
  return math.floor(n)
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local ttl_ms = tonumber(ARGV[1])
local expiry = now + ttl_ms * 1000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local mc = limit(redis.call('HGET', KEYS[2], 'max_concurrent'), ARGV[2])
local active = redis.call('ZCARD', KEYS[1])
local renewed, retaken, lost = 0, {}, {}
for i = 3, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], 'XX', expiry, ARGV[i])
    renewed = renewed + 1
  elseif mc <= 0 or active < mc then
    redis.call('ZADD', KEYS[1], expiry, ARGV[i])
    active = active + 1
    retaken[#retaken + 1] = ARGV[i]
  else
    lost[#lost + 1] = ARGV[i]
  end
end
if active > 0 and redis.call('PTTL', KEYS[1]) < ttl_ms + 1000 then
  redis.call('PEXPIRE', KEYS[1], ttl_ms + 1000)
end
return {renewed, retaken, lost}
