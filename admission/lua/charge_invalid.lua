-- Charge one request of a tenant's per-minute request limit for a request refused as invalid after it was
-- authenticated (parsing it cost the gateway CPU; nothing else is charged: no tokens, no lease).
-- KEYS[1] config hash, KEYS[2] bucket hash {tok, req, ts} (under {t:<tenant>})
-- ARGV: default_tpm, default_rpm
-- Returns {charged (0/1), req_remaining, retry_after_ms}: retry_after_ms > 0 when no request is left now
-- (the time until one is). The request level never goes below 0. Clock: Redis TIME (microseconds).
local WINDOW_US = 60000000

local function limit(v, default)
  local n = tonumber(v)
  if n == nil or n ~= n or n < 0 or n == math.huge then n = tonumber(default) end
  return math.floor(n)
end

if redis.call('EXISTS', KEYS[1]) == 0 then
  return {0, 0, 0}
end
local cfg = redis.call('HMGET', KEYS[1], 'tpm', 'rpm')
local tpm = limit(cfg[1], ARGV[1])
local rpm = limit(cfg[2], ARGV[2])
if rpm <= 0 then
  return {0, 0, 0}
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local b = redis.call('HMGET', KEYS[2], 'tok', 'req', 'ts')
local ts = tonumber(b[3]) or now
local elapsed = math.max(0, now - ts)
local tok = tonumber(b[1]) or tpm
local req = tonumber(b[2]) or rpm
-- refill both levels: they share one timestamp
if tpm > 0 then tok = math.min(tpm, tok + elapsed * tpm / WINDOW_US) end
req = math.max(0, math.min(rpm, req + elapsed * rpm / WINDOW_US) - 1)
redis.call('HSET', KEYS[2], 'tok', string.format('%.6f', tok), 'req', string.format('%.6f', req),
           'ts', string.format('%.0f', now))
redis.call('PEXPIRE', KEYS[2], WINDOW_US / 1000 + 1000)
local retry = 0
if req < 1 then retry = math.ceil((1 - req) * WINDOW_US / rpm / 1000) + 1 end
return {1, math.floor(req), retry}
