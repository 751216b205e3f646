-- Atomically hold a request's maximum cost (integer micro-dollars) at every level on its path.
-- All keys share one organization's hash tag {o:<org>}.
-- KEYS[1] holds zset (hold record name -> expiry ms), KEYS[2] this hold's record hash,
--   then per level i: KEYS[1+2i] config hash, KEYS[2+2i] balance hash {p, spent, held}
-- ARGV: cost, hold_ttl_ms, n_levels, then per level: label, config field prefix ('' or 'user_')
-- Returns {0, level, budget, remaining after this hold, reset_s} admitted (the narrowest level with a budget;
-- level '' when none has one), or {1 (denied) | 2 (can never fit), level, budget, spent+held, reset_s}.
-- Nothing is written unless every level admits. Clock: Redis TIME; periods are calendar UTC days/months.
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

local function period(kind)  -- period id and its end (epoch seconds)
  if kind == 'day' then return 'd' .. today, (today + 1) * 86400 end
  local y, m = civil(today)
  local ny, nm = y, m + 1
  if nm > 12 then ny, nm = y + 1, 1 end
  return 'm' .. (y * 12 + m), days_from_civil(ny, nm) * 86400
end

-- Holds of gateways that never settled (crashed) give their amount back once their lease ends.
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms, 'LIMIT', 0, 16)
for _, rec in ipairs(expired) do
  local h = redis.call('HMGET', rec, 'amt', 'bals', 'state')
  if h[3] == 'open' then
    for bal in string.gmatch(h[2] or '', '%S+') do redis.call('HINCRBY', bal, 'held', -tonumber(h[1])) end
    redis.call('HSET', rec, 'state', 'expired')
  end
  redis.call('ZREM', KEYS[1], rec)
end

local cost = tonumber(ARGV[1])
local ttl_ms = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local pids, bals = {}, {}
local narrow = {0, '', 0, 0, 0}
for i = 1, n do
  local label, prefix = ARGV[2 + 2 * i], ARGV[3 + 2 * i]
  local cfg = redis.call('HMGET', KEYS[1 + 2 * i], prefix .. 'budget_micro', prefix .. 'period')
  local budget = tonumber(cfg[1]) or 0
  local pid, reset_s = period(cfg[2] == 'day' and 'day' or 'month')
  local b = redis.call('HMGET', KEYS[2 + 2 * i], 'p', 'spent', 'held')
  local spent = (b[1] == pid) and (tonumber(b[2]) or 0) or 0
  local held = tonumber(b[3]) or 0
  if budget > 0 then
    if cost > budget then return {2, label, budget, spent + held, reset_s} end
    if spent + held + cost > budget then return {1, label, budget, spent + held, reset_s} end
    narrow = {0, label, budget, budget - spent - held - cost, reset_s}
  end
  pids[i] = pid
  bals[i] = KEYS[2 + 2 * i]
end

for i = 1, n do
  local bal = bals[i]
  if redis.call('HGET', bal, 'p') ~= pids[i] then redis.call('HSET', bal, 'p', pids[i], 'spent', 0) end
  redis.call('HINCRBY', bal, 'held', cost)
  redis.call('EXPIRE', bal, 40 * 86400)
end
redis.call('HSET', KEYS[2], 'amt', cost, 'bals', table.concat(bals, ' '), 'pids', table.concat(pids, ' '),
           'state', 'open')
redis.call('PEXPIRE', KEYS[2], ttl_ms + 86400000)
redis.call('ZADD', KEYS[1], now_ms + ttl_ms, KEYS[2])
return narrow
