-- Settle a finished request: release its lease, refund unused tokens, meter usage.
-- KEYS[1] config hash, KEYS[2] bucket hash, KEYS[3] leases zset, KEYS[4] usage hash of the day
-- ARGV: lease_id, refund_tokens, prompt_tokens, cached_tokens, completion_tokens, usage_ttl_s,
--       default_tpm, default_rpm, served (1: meter the usage; 0: never served, also refund the request)
-- Refunds are applied only if this call released the lease, so a repeated settle refunds nothing.
-- Returns {released (0/1), token bucket level after the refund (floor)}.
local WINDOW_US = 60000000

local function limit(v, default)
  local n = tonumber(v)
  if n == nil or n ~= n or n < 0 or n == math.huge then n = tonumber(default) end
  return math.floor(n)
end

local released = redis.call('ZREM', KEYS[3], ARGV[1])
local refund = tonumber(ARGV[2])
local served = ARGV[9] == '1'
local level = -1
if released == 1 and (refund > 0 or not served) then
  local cfg = redis.call('HMGET', KEYS[1], 'tpm', 'rpm')
  local tpm = limit(cfg[1], ARGV[7])
  local rpm = limit(cfg[2], ARGV[8])
  if tpm > 0 or rpm > 0 then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
    local b = redis.call('HMGET', KEYS[2], 'tok', 'req', 'ts')
    local elapsed = math.max(0, now - (tonumber(b[3]) or now))
    local tok = tonumber(b[1]) or tpm
    if tpm > 0 then tok = math.min(tpm, tok + elapsed * tpm / WINDOW_US + refund) end
    -- both buckets share one timestamp, so the request bucket is refilled to the same instant
    local req = tonumber(b[2]) or rpm
    if not served then req = req + 1 end
    if rpm > 0 then req = math.min(rpm, req + elapsed * rpm / WINDOW_US) end
    redis.call('HSET', KEYS[2], 'tok', string.format('%.6f', tok), 'req', string.format('%.6f', req),
               'ts', string.format('%.0f', now))
    redis.call('PEXPIRE', KEYS[2], WINDOW_US / 1000 + 1000)
    level = math.floor(tok)
  end
end
if served then
  redis.call('HINCRBY', KEYS[4], 'requests', 1)
  redis.call('HINCRBY', KEYS[4], 'prompt_tokens', ARGV[3])
  redis.call('HINCRBY', KEYS[4], 'cached_tokens', ARGV[4])
  redis.call('HINCRBY', KEYS[4], 'completion_tokens', ARGV[5])
  redis.call('EXPIRE', KEYS[4], ARGV[6])
end
return {released, level}
