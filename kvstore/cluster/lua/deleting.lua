-- ARGV: prefix, member, tier, keys... This member deletes these values now: it takes each
-- key's entry until ``evicted``, as make_room takes its victims, so that no reservation of the
-- key is granted meanwhile. A resident entry becomes evicting (a reservation is answered busy,
-- not "present" for a value about to be gone); so does a pending one (its writer's commit
-- answers 0: the value it may have written before the delete is gone, and it undoes its
-- write), which also leaves its writer's set of entries in flight: exactly one member holds
-- an evicting entry (left in both, the writer reaped or restarted was handed it too, and
-- dropped it while this member still deleted: a durable put of the key granted and committed
-- then lost its value to this delete). A key with no entry gets a 0-byte evicting one (a
-- reservation granted between this and the delete would have its value deleted, and could
-- be committed first). An entry another member evicts now stays that member's to drop.
local m, T = ARGV[2], ARGV[3]
for i = 4, #ARGV do
  local key = ARGV[i]
  local v = redis.call('HGET', P .. 't:' .. T, key)
  if not v then
    redis.call('HSET', P .. 't:' .. T, key, 'e 0 0 ' .. m)
    redis.call('SADD', P .. 'f:' .. T .. ':' .. m, key)
  else
    local s, fp, size, owner = parse(v)
    if s ~= 'e' then
      redis.call('HSET', P .. 't:' .. T, key, 'e ' .. fp .. ' ' .. size .. ' ' .. owner)
      redis.call('ZREM', P .. 'q:' .. T .. ':' .. owner, key)
      redis.call('SREM', P .. 'f:' .. T .. ':' .. owner, key)
      redis.call('SADD', P .. 'f:' .. T .. ':' .. m, key)
    end
  end
end
return used(T)
