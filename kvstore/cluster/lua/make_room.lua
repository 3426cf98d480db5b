-- ARGV: prefix, member, tier, need, member_ttl_ms, max_victims, token. Returns {'ok', used} when
-- ``need`` bytes are free, {'full', used} when nothing can go, else {'evict', used, keys...}:
-- chunks this member must delete now (then ``evicted``), taken from the member furthest
-- above its fair share (budget / live members; a dead member's share is 0), oldest first,
-- skipping every chunk a live member pins. An 'evict' answer is kept under its call's token
-- for an hour: run again with the same token (redis-py retries a command whose reply was
-- lost), the script answers the same victims instead of choosing more, and a member that
-- lost both replies asks for them by the token (``room_victims.lua``).
local m, T, need, ttl, most = ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local memo = P .. 'room:' .. ARGV[7]
if redis.call('EXISTS', memo) == 1 then return redis.call('LRANGE', memo, 0, -1) end
local budget = tonumber(redis.call('HGET', P .. 'budget', T))
local u = used(T)
if budget - u >= need then return {'ok', u} end
local want = need - (budget - u)
local now, alive_after = clock(ttl)
local live = redis.call('ZRANGEBYSCORE', P .. 'beats', alive_after, '+inf')
local share = budget / math.max(#live, 1)
local is_live_m = {}
for _, x in ipairs(live) do is_live_m[x] = true end
local by = {}
local flat = redis.call('HGETALL', P .. 'u:' .. T)
for i = 1, #flat, 2 do
  local over = tonumber(flat[i + 1]) - (is_live_m[flat[i]] and share or 0)
  table.insert(by, {flat[i], over})
end
table.sort(by, function(a, b) return a[2] > b[2] end)
local function pinned(key)
  for _, x in ipairs(live) do
    local until_ms = redis.call('ZSCORE', P .. 'pins:' .. x, key)
    if until_ms and tonumber(until_ms) > now then return true end
  end
  return false
end
-- at most 4096 chunks looked at per call, pinned ones included: Redis runs nothing else meanwhile
local out, freed, scanned = {'evict', u}, 0, 0
for _, cand in ipairs(by) do
  local q = P .. 'q:' .. T .. ':' .. cand[1]
  local start = 0
  while freed < want and #out - 2 < most and scanned < 4096 do
    local batch = redis.call('ZRANGE', q, start, start + 63)
    if #batch == 0 then break end
    scanned = scanned + #batch
    local kept = 0
    for _, key in ipairs(batch) do
      if freed >= want or #out - 2 >= most then break end
      if pinned(key) then
        kept = kept + 1
      else
        local s, fp, size, owner = parse(redis.call('HGET', P .. 't:' .. T, key))
        redis.call('HSET', P .. 't:' .. T, key, 'e ' .. fp .. ' ' .. size .. ' ' .. owner)
        redis.call('ZREM', q, key)
        redis.call('SADD', P .. 'f:' .. T .. ':' .. m, key)
        table.insert(out, key)
        freed = freed + fp
      end
    end
    start = start + kept
  end
  if freed >= want or #out - 2 >= most or scanned >= 4096 then break end
end
if #out == 2 then return {'full', u} end
redis.call('RPUSH', memo, unpack(out))
redis.call('PEXPIRE', memo, 3600000)
return out
