-- Atomically check and reserve a request's budget for one tenant.
-- KEYS[1] config hash, KEYS[2] bucket hash {tok, req, ts}, KEYS[3] leases zset (all under {t:<tenant>})
-- ARGV: cost_tokens, lease_id, lease_ttl_ms, default_tpm, default_rpm, default_max_concurrent,
--       concurrency_retry_cap_ms
-- Returns {status, limit_name, tpm, tok_remaining, tok_reset_ms, rpm, req_remaining, req_reset_ms,
--          max_concurrent, active, retry_after_ms, used, requested}
-- status: 0 admitted, 1 denied, 2 can never fit, 3 unknown tenant, 4 disabled.
-- Nothing is written unless every check passes. Clock: Redis TIME (microseconds).
local WINDOW_US = 60000000

local function limit(v, default)
  local n = tonumber(v)
  if n == nil or n ~= n or n < 0 or n == math.huge then n = tonumber(default) end
  return math.floor(n)
end

if redis.call('EXISTS', KEYS[1]) == 0 then
  return {3, '', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
end
local cfg = redis.call('HMGET', KEYS[1], 'status', 'tpm', 'rpm', 'max_concurrent')
if cfg[1] and cfg[1] ~= '' and cfg[1] ~= 'active' then
  return {4, '', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
end
local tpm = limit(cfg[2], ARGV[4])
local rpm = limit(cfg[3], ARGV[5])
local mc = limit(cfg[4], ARGV[6])
local cost = tonumber(ARGV[1])
local ttl_ms = tonumber(ARGV[3])

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local b = redis.call('HMGET', KEYS[2], 'tok', 'req', 'ts')
local ts = tonumber(b[3]) or now
local elapsed = math.max(0, now - ts)
local tok = tonumber(b[1]) or tpm
local req = tonumber(b[2]) or rpm
if tpm > 0 then tok = math.min(tpm, tok + elapsed * tpm / WINDOW_US) end
if rpm > 0 then req = math.min(rpm, req + elapsed * rpm / WINDOW_US) end

local function reset_ms(level, cap)
  if cap <= 0 or level >= cap then return 0 end
  return math.ceil((cap - level) * WINDOW_US / cap / 1000)
end

redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local active = redis.call('ZCARD', KEYS[3])

local function reply(status, name, retry, used, requested, act)
  return {status, name, tpm, math.floor(math.max(tok, 0)), reset_ms(tok, tpm), rpm,
          math.floor(math.max(req, 0)), reset_ms(req, rpm), mc, act, retry, used, requested}
end

if tpm > 0 and cost > tpm then
  return reply(2, 'tokens', 0, 0, cost, active)
end

-- Every failing limit is evaluated; the reported one is the one that frees up last.
local deny_name, deny_retry, deny_used, deny_req = nil, -1, 0, 0
if tpm > 0 and tok < cost then
  -- +1 ms absorbs float rounding so that waiting exactly retry_after_ms is always enough.
  local wait = math.ceil((cost - tok) * WINDOW_US / tpm / 1000) + 1
  if wait > deny_retry then
    deny_name, deny_retry, deny_used, deny_req = 'tokens', wait, math.ceil(tpm - tok), cost
  end
end
if rpm > 0 and req < 1 then
  local wait = math.ceil((1 - req) * WINDOW_US / rpm / 1000) + 1
  if wait > deny_retry then
    deny_name, deny_retry, deny_used, deny_req = 'requests', wait, math.ceil(rpm - req), 1
  end
end
if mc > 0 and active >= mc then
  -- A lease frees when its request ends (unknown) or at its expiry at the latest.
  local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  local wait = math.ceil((tonumber(first[2]) - now) / 1000)
  wait = math.max(1, math.min(wait, tonumber(ARGV[7])))
  if wait > deny_retry then
    deny_name, deny_retry, deny_used, deny_req = 'concurrency', wait, active, 1
  end
end
if deny_name then
  return reply(1, deny_name, deny_retry, deny_used, deny_req, active)
end

if tpm > 0 then tok = tok - cost end
if rpm > 0 then req = req - 1 end
redis.call('HSET', KEYS[2], 'tok', string.format('%.6f', tok), 'req', string.format('%.6f', req),
           'ts', string.format('%.0f', now))
-- An idle bucket is full again after one window, and a missing bucket reads as full.
redis.call('PEXPIRE', KEYS[2], WINDOW_US / 1000 + 1000)
redis.call('ZADD', KEYS[3], now + ttl_ms * 1000, ARGV[2])
if redis.call('PTTL', KEYS[3]) < ttl_ms + 1000 then
  redis.call('PEXPIRE', KEYS[3], ttl_ms + 1000)
end
return reply(0, '', 0, 0, cost, active + 1)
