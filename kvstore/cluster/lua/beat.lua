-- ARGV: prefix, member, info json, member_ttl_ms, forget_after_ms, token, then the tiers this
-- member mounts (none: every tier). Beats, drops dead members' pins and hands this member
-- their unfinished writes and deletes on its tiers: returns {'tier key', ...} to delete (then
-- ``evicted``). Work on a tier it lacks stays the dead member's, for a member with the tier
-- (taken, it stayed evicting in this member's set for good), and keeps the dead member known. What it hands is kept under the call's token
-- for an hour: run again with the same token (redis-py's retry of a lost reply, or the next
-- beat after a failed one), it answers those of them still this member's to delete. Without
-- it a lost reply left them evicting in this member's set, which nothing would ever delete
-- while the member lived: bytes counted for good, the chunks busy to every writer.
local m, ttl, forget = ARGV[2], tonumber(ARGV[4]), tonumber(ARGV[5])
local memo = P .. 'reap:' .. ARGV[6]
local now, alive_after = clock(ttl)
redis.call('ZADD', P .. 'beats', now, m)
redis.call('HSET', P .. 'info', m, ARGV[3])
redis.call('ZREMRANGEBYSCORE', P .. 'pins:' .. m, '-inf', now)
local out = {}
if redis.call('EXISTS', memo) == 1 then
  for _, item in ipairs(redis.call('LRANGE', memo, 0, -1)) do
    local T, key = string.match(item, '^(%S+) (%S+)$')
    local v = redis.call('HGET', P .. 't:' .. T, key)
    if v and string.sub(v, 1, 1) == 'e' and redis.call('SISMEMBER', P .. 'f:' .. T .. ':' .. m, key) == 1 then
      table.insert(out, item)
    end
  end
  return out
end
local tiers = redis.call('HKEYS', P .. 'budget')
local mounted = {}
for i = 7, #ARGV do mounted[ARGV[i]] = true end
if #ARGV < 7 then for _, T in ipairs(tiers) do mounted[T] = true end end
for _, d in ipairs(redis.call('ZRANGEBYSCORE', P .. 'beats', '-inf', '(' .. alive_after)) do
  redis.call('DEL', P .. 'pins:' .. d)
  local holds = false
  for _, T in ipairs(tiers) do
    local fset = P .. 'f:' .. T .. ':' .. d
    for _, key in ipairs(mounted[T] and redis.call('SMEMBERS', fset) or {}) do
      local v = redis.call('HGET', P .. 't:' .. T, key)
      redis.call('SREM', fset, key)
      if v then
        local s, fp, size, owner = parse(v)
        if s ~= 'r' then
          redis.call('HSET', P .. 't:' .. T, key, 'e ' .. fp .. ' ' .. size .. ' ' .. owner)
          redis.call('SADD', P .. 'f:' .. T .. ':' .. m, key)
          table.insert(out, T .. ' ' .. key)
          redis.call('RPUSH', memo, T .. ' ' .. key)
        end
      end
    end
    if redis.call('HEXISTS', P .. 'u:' .. T, d) == 1 or redis.call('SCARD', fset) > 0 then holds = true end
  end
  if not holds and tonumber(redis.call('ZSCORE', P .. 'beats', d)) < now - forget then
    redis.call('ZREM', P .. 'beats', d)
    redis.call('HDEL', P .. 'info', d)
  end
end
if #out > 0 then redis.call('PEXPIRE', memo, 3600000) end
return out
