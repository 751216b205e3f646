-- Settle a money hold: give back the held maximum, the concurrency slot and the tokens not used at every level,
-- and charge the exact cost, once.
-- KEYS[1] holds zset, KEYS[2] hold record, KEYS[3] spend hash of the UTC day; all under {o:<org>}.
-- ARGV: cost (micro-dollars), spend_ttl_s, input, cached, output, tokens used, then spend dimensions (field
-- prefixes).
-- Returns 1 if this call settled the hold, 0 if it was settled before (nothing is charged twice).
local h = redis.call('HMGET', KEYS[2], 'amt', 'bals', 'pids', 'state', 'tok')
if h[4] ~= 'open' and h[4] ~= 'expired' then return 0 end
local cost = tonumber(ARGV[1])
local pids = {}
for pid in string.gmatch(h[3] or '', '%S+') do pids[#pids + 1] = pid end
local unused = math.max(0, (tonumber(h[5]) or 0) - tonumber(ARGV[6]))
local i = 0
for bal in string.gmatch(h[2] or '', '%S+') do
  i = i + 1
  if h[4] == 'open' then
    redis.call('HINCRBY', bal, 'held', 0 - tonumber(h[1]))
    if h[5] then redis.call('HINCRBY', bal, 'active', -1) end  -- holds made before levels counted them: no
  end
  -- tokens held but not used go back to a level's tpm bucket (the next reserve caps it at the limit)
  if unused > 0 and redis.call('HEXISTS', bal, 'tok') == 1 then
    redis.call('HINCRBYFLOAT', bal, 'tok', unused)
  end
  -- A hold reserved in a period that has ended since is not charged to the new period's budget. A rolling
  -- window's (period R<bucket seconds>) spend goes to the bucket of now.
  local pid = pids[i] or ''
  if string.sub(pid, 1, 1) == 'R' then
    local now = tonumber(redis.call('TIME')[1])
    local size = tonumber(string.sub(pid, 2))
    redis.call('HINCRBY', bal, 'r:' .. math.floor(now / size), cost)
  elseif redis.call('HGET', bal, 'p') == pids[i] then
    redis.call('HINCRBY', bal, 'spent', cost)
  end
end
redis.call('ZREM', KEYS[1], KEYS[2])
redis.call('HSET', KEYS[2], 'state', 'done', 'cost', cost)
local input, cached, output = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
for j = 7, #ARGV do
  local d = ARGV[j]
  redis.call('HINCRBY', KEYS[3], d .. '|cost_micro', cost)
  redis.call('HINCRBY', KEYS[3], d .. '|requests', 1)
  redis.call('HINCRBY', KEYS[3], d .. '|input_tokens', input)
  redis.call('HINCRBY', KEYS[3], d .. '|cached_tokens', cached)
  redis.call('HINCRBY', KEYS[3], d .. '|output_tokens', output)
end
redis.call('EXPIRE', KEYS[3], tonumber(ARGV[2]))
return 1
