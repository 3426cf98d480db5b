-- ARGV: prefix, member, tier, key, token. This member undoes a write of the key that was not
-- committed: it takes the key's entry, as ``deleting`` does, but only where no other member's
-- value can be under the key: no entry (the write's was taken and dropped since), or this
-- member's own pending one. Returns 'mine' (taken, evicting: delete the value, then
-- ``evicted``), 'kept' (a resident or pending entry another member holds, or this member's
-- committed one: the value is that one's, never deleted by the undo) or 'busy' (a member
-- deletes or evicts it now: ask again later). A 'mine' is kept under the token for an hour, so
-- a retry of a call whose reply was lost answers 'mine' again instead of 'busy', while the
-- entry is still this member's to delete: taken from it since (it was reaped as dead), the
-- undo is its reaper's, and the key may hold another member's value by now ('kept').
local m, T, key = ARGV[2], ARGV[3], ARGV[4]
local memo = P .. 'undo:' .. ARGV[5]
local v = redis.call('HGET', P .. 't:' .. T, key)
if redis.call('EXISTS', memo) == 1 then
  if v and string.sub(v, 1, 1) == 'e' and redis.call('SISMEMBER', P .. 'f:' .. T .. ':' .. m, key) == 1 then
    return 'mine'
  end
  return 'kept'
end
if v then
  local s, fp, size, owner = parse(v)
  if s == 'e' then return 'busy' end
  if s ~= 'p' or owner ~= m then return 'kept' end
  redis.call('HSET', P .. 't:' .. T, key, 'e ' .. fp .. ' ' .. size .. ' ' .. m)
else
  redis.call('HSET', P .. 't:' .. T, key, 'e 0 0 ' .. m)
end
redis.call('SADD', P .. 'f:' .. T .. ':' .. m, key)
redis.call('SET', memo, '1', 'PX', 3600000)
return 'mine'
