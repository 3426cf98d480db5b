-- ARGV: prefix, member, tier, keys... This member finished deleting them (state e). Only the
-- entries it took (in its set) are dropped: one another member evicts or deletes now is that
-- member's to drop once its value is gone, or a reservation granted before would see its
-- value deleted after its commit.
local m, T = ARGV[2], ARGV[3]
for i = 4, #ARGV do
  local key = ARGV[i]
  if redis.call('SREM', P .. 'f:' .. T .. ':' .. m, key) == 1 then
    local v = redis.call('HGET', P .. 't:' .. T, key)
    if v and string.sub(v, 1, 1) == 'e' then drop_entry(T, key) end
  end
end
return used(T)
