-- Atomically hold a request's maximum cost (integer micro-dollars) and its tokens at every level on its path.
-- All keys share one organization's hash tag {o:<org>}.
-- KEYS[1] holds zset (hold record name -> expiry ms), KEYS[2] this hold's record hash,
--   then per level i: KEYS[1+2i] config hash, KEYS[2+2i] balance hash {p, spent, held, tok, req, ts, active}
-- ARGV: cost, hold_ttl_ms, n_levels, tokens (prompt + max_tokens), then per level: label, config field prefix
--   ('' or 'user_'), optional ('1': a level without any config is skipped, its balance untouched; '0').
--   A level's config may hold <prefix>budget_micro, period, tpm, rpm, max_concurrent.
-- Returns {0, level, budget, remaining after this hold, reset_s, '', 0} admitted (the narrowest level with a
-- budget; level '' when none has one), or {1 (denied) | 2 (can never fit), level, limit, used, reset_s, kind,
-- retry_ms}: kind 'budget' or 'rolling' (a rolling window's budget; limit/used in micro-dollars), 'tpm', 'rpm'
-- or 'concurrency'; of the failing rate limits, the one that frees up last is reported. Nothing is written
-- unless every level admits (but for dropping buckets that left a rolling window).
-- Clock: Redis TIME; budget periods are calendar UTC days/months or rolling windows (24h in hourly buckets,
-- 30d in daily ones); rate limits refill continuously over 60 s.
local function floor(x) return math.floor(x) end

local function civil(days)  -- days since 1970-01-01 -> year, month
  local z = days + 719468
  local era = floor(z / 146097)
  local doe = z - era * 146097
  local yoe = floor((doe - floor(doe / 1460) + floor(doe / 36524) - floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + floor(yoe / 4) - floor(yoe / 100))
  local mp = floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m
end

local function days_from_civil(y, m)  -- first day of month m of year y -> days since 1970-01-01
  if m <= 2 then y = y - 1 end
  local era = floor(y / 400)
  local yoe = y - era * 400
  local mp = (m + 9) % 12
  local doy = floor((153 * mp + 2) / 5)
  return era * 146097 + yoe * 365 + floor(yoe / 4) - floor(yoe / 100) + doy - 719468
end

local t = redis.call('TIME')
local now_s = tonumber(t[1])
local now_ms = now_s * 1000 + floor(tonumber(t[2]) / 1000)
local today = floor(now_s / 86400)

-- Rolling windows: spend in buckets (balance fields r:<bucket index>), summed over the window's last buckets.
local ROLLING = {['24h'] = {3600, 24}, ['30d'] = {86400, 30}}

local function period(kind)  -- period id and its end (epoch seconds); a rolling window's id is R<bucket s>
  local w = ROLLING[kind]
  if w then return 'R' .. w[1], (floor(now_s / w[1]) + 1) * w[1] end
  if kind == 'day' then return 'd' .. today, (today + 1) * 86400 end
  local y, m = civil(today)
  local ny, nm = y, m + 1
  if nm > 12 then ny, nm = y + 1, 1 end
  return 'm' .. (y * 12 + m), days_from_civil(ny, nm) * 86400
end

-- Holds of gateways that never settled (crashed) give their amount and their concurrency back once their lease
-- ends.
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms, 'LIMIT', 0, 16)
for _, rec in ipairs(expired) do
  local h = redis.call('HMGET', rec, 'amt', 'bals', 'state', 'tok')
  if h[3] == 'open' then
    for bal in string.gmatch(h[2] or '', '%S+') do
      redis.call('HINCRBY', bal, 'held', 0 - tonumber(h[1]))
      if h[4] then redis.call('HINCRBY', bal, 'active', -1) end
    end
    redis.call('HSET', rec, 'state', 'expired')
  end
  redis.call('ZREM', KEYS[1], rec)
end

local WINDOW_US = 60000000
local now_us = now_s * 1000000 + tonumber(t[2])
local cost = tonumber(ARGV[1])
local ttl_ms = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local tokens = tonumber(ARGV[4])

local function limit(v)  -- a config field as a non-negative integer limit (0: none)
  local x = tonumber(v)
  if x == nil or x ~= x or x < 0 or x == math.huge then return 0 end
  return floor(x)
end

local function refill(level, cap, ts)  -- a bucket's level now (full when it was never used)
  if level == nil then return cap end
  return math.min(cap, level + math.max(0, now_us - ts) * cap / WINDOW_US)
end

local function rolling_spent(bal, size, count)  -- the window's spend; buckets that left it are deleted
  local last = floor(now_s / size)
  local fields, old = {}, {}
  for j = 0, count - 1 do fields[#fields + 1] = 'r:' .. (last - j) end
  for j = count, count + 23 do old[#old + 1] = 'r:' .. (last - j) end
  redis.call('HDEL', bal, unpack(old))
  local sum = 0
  for _, v in ipairs(redis.call('HMGET', bal, unpack(fields))) do sum = sum + (tonumber(v) or 0) end
  return sum
end

local pids, bals, buckets = {}, {}, {}
local narrow = {0, '', 0, 0, 0, '', 0}
local deny = nil
for i = 1, n do
  local label, prefix = ARGV[2 + 3 * i], ARGV[3 + 3 * i]
  local cfg = redis.call('HMGET', KEYS[1 + 2 * i], prefix .. 'budget_micro', prefix .. 'period',
                         prefix .. 'tpm', prefix .. 'rpm', prefix .. 'max_concurrent')
  if ARGV[4 + 3 * i] ~= '1' or cfg[1] or cfg[2] or cfg[3] or cfg[4] or cfg[5] then
    local budget = tonumber(cfg[1]) or 0
    local pid, reset_s = period((cfg[2] == 'day' or ROLLING[cfg[2]]) and cfg[2] or 'month')
    local b = redis.call('HMGET', KEYS[2 + 2 * i], 'p', 'spent', 'held', 'tok', 'req', 'ts', 'active', 'x')
    local spent = (b[1] == pid) and (tonumber(b[2]) or 0) or 0
    local w = ROLLING[cfg[2]]
    if w and budget > 0 then spent = rolling_spent(KEYS[2 + 2 * i], w[1], w[2]) end
    local held = tonumber(b[3]) or 0
    if budget > 0 then
      local kind = w and 'rolling' or 'budget'
      if cost > budget then return {2, label, budget, spent + held, reset_s, kind, 0} end
      if spent + held + cost > budget then return {1, label, budget, spent + held, reset_s, kind, 0} end
      narrow = {0, label, budget, budget - spent - held - cost, reset_s, '', 0}
    end
    local tpm, rpm, mc = limit(cfg[3]), limit(cfg[4]), limit(cfg[5])
    local ts = tonumber(b[6]) or now_us
    local tok = tpm > 0 and refill(tonumber(b[4]), tpm, ts) or nil
    local req = rpm > 0 and refill(tonumber(b[5]), rpm, ts) or nil
    if tpm > 0 and tokens > tpm then return {2, label, tpm, 0, reset_s, 'tpm', 0} end
    local function fail(kind, lim, used, wait)
      if deny == nil or wait > deny[7] then deny = {1, label, lim, used, reset_s, kind, wait} end
    end
    if tok ~= nil and tok < tokens then
      fail('tpm', tpm, math.ceil(tpm - tok), math.ceil((tokens - tok) * WINDOW_US / tpm / 1000) + 1)
    end
    if req ~= nil and req < 1 then
      fail('rpm', rpm, math.ceil(rpm - req), math.ceil((1 - req) * WINDOW_US / rpm / 1000) + 1)
    end
    local active = tonumber(b[7]) or 0
    if mc > 0 and active >= mc then fail('concurrency', mc, active, 1000) end  -- frees when a request ends
    pids[#pids + 1] = pid
    bals[#bals + 1] = KEYS[2 + 2 * i]
    buckets[#buckets + 1] = {tok, req, b[1], b[8]}
  end
end
if deny ~= nil then return deny end

for i = 1, #bals do
  local bal, st = bals[i], buckets[i]
  local sets = {}
  local function set(f, v) sets[#sets + 1] = f; sets[#sets + 1] = v end
  -- a new period starts from 0 (a rolling window keeps its buckets: they are its history)
  if st[3] ~= pids[i] then set('p', pids[i]); set('spent', 0) end
  if st[1] ~= nil or st[2] ~= nil then set('ts', now_us) end
  if st[1] ~= nil then set('tok', tostring(st[1] - tokens)) end
  if st[2] ~= nil then set('req', tostring(st[2] - 1)) end
  local renew = st[4] ~= tostring(today)  -- the balance lives 40 days past its last hold (renewed daily)
  if renew then set('x', today) end
  if #sets > 0 then redis.call('HSET', bal, unpack(sets)) end
  redis.call('HINCRBY', bal, 'held', cost)
  redis.call('HINCRBY', bal, 'active', 1)
  if renew then redis.call('EXPIRE', bal, 40 * 86400) end
end
redis.call('HSET', KEYS[2], 'amt', cost, 'tok', tokens, 'bals', table.concat(bals, ' '),
           'pids', table.concat(pids, ' '), 'state', 'open')
redis.call('PEXPIRE', KEYS[2], ttl_ms + 86400000)
redis.call('ZADD', KEYS[1], now_ms + ttl_ms, KEYS[2])
return narrow
