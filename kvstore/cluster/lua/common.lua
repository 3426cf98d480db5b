local P = ARGV[1]
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function parse(v)
  local s, fp, size, owner = string.match(v, '^(%a) (%d+) (%d+) (.*)$')
  return s, tonumber(fp), tonumber(size), owner
end
-- The time, and the oldest heartbeat of a live member. When nobody reached the ledger for
-- half a member_ttl (its primary failed over, Redis restarted), every member was cut off
-- alike: for one member_ttl, every member that has not left counts as live.
local function clock(ttl)
  local now = now_ms()
  local seen = tonumber(redis.call('GET', P .. 'seen') or '0')
  if seen > 0 and now - seen > ttl / 2 then redis.call('SET', P .. 'grace', now + ttl) end
  redis.call('SET', P .. 'seen', now)
  if now < tonumber(redis.call('GET', P .. 'grace') or '0') then return now, 1 end
  return now, now - ttl
end
local function is_live(m, alive_after)
  local beat = redis.call('ZSCORE', P .. 'beats', m)
  return beat ~= false and tonumber(beat) >= alive_after
end
-- A zero delta is skipped: Lua writes the -0 of a 0-byte entry dropped as "-0", which HINCRBY refuses
local function add_used(T, m, delta)
  if delta == 0 then return end
  redis.call('HINCRBY', P .. 'used', T, delta)
  if redis.call('HINCRBY', P .. 'u:' .. T, m, delta) == 0 then
    redis.call('HDEL', P .. 'u:' .. T, m)
  end
end
local function used(T)
  return tonumber(redis.call('HGET', P .. 'used', T) or '0')
end
local function drop_entry(T, key)
  local v = redis.call('HGET', P .. 't:' .. T, key)
  if not v then return end
  local s, fp, size, owner = parse(v)
  redis.call('HDEL', P .. 't:' .. T, key)
  redis.call('ZREM', P .. 'q:' .. T .. ':' .. owner, key)
  redis.call('SREM', P .. 'f:' .. T .. ':' .. owner, key)
  add_used(T, owner, -fp)
end
