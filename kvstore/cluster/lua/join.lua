-- ARGV: prefix, member, info json, then tier/budget pairs. Returns {'ok', keys to remove...}
-- (the previous incarnation's unfinished writes, now this member's to delete) or
-- {'budget', tier, the cluster's budget} when a budget differs.
local m = ARGV[2]
for i = 4, #ARGV, 2 do
  local T, b = ARGV[i], ARGV[i + 1]
  redis.call('HSETNX', P .. 'budget', T, b)
  local have = redis.call('HGET', P .. 'budget', T)
  if have ~= b then return {'budget', T, have} end
end
redis.call('ZADD', P .. 'beats', now_ms(), m)
redis.call('HSET', P .. 'info', m, ARGV[3])
redis.call('DEL', P .. 'pins:' .. m)
local out = {'ok'}
for i = 4, #ARGV, 2 do
  local T = ARGV[i]
  for _, key in ipairs(redis.call('SMEMBERS', P .. 'f:' .. T .. ':' .. m)) do
    local v = redis.call('HGET', P .. 't:' .. T, key)
    if v then
      local s, fp, size, owner = parse(v)
      redis.call('HSET', P .. 't:' .. T, key, 'e ' .. fp .. ' ' .. size .. ' ' .. owner)
      table.insert(out, T .. ' ' .. key)
    else
      redis.call('SREM', P .. 'f:' .. T .. ':' .. m, key)
    end
  end
end
return out
