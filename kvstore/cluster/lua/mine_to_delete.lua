-- ARGV: prefix, member, tier, keys... Those of the keys this member is to delete now (state
-- e, in its set): a delete of them that failed is this member's to finish.
local m, T = ARGV[2], ARGV[3]
local out = {}
for i = 4, #ARGV do
  local v = redis.call('HGET', P .. 't:' .. T, ARGV[i])
  if v and string.sub(v, 1, 1) == 'e' and redis.call('SISMEMBER', P .. 'f:' .. T .. ':' .. m, ARGV[i]) == 1 then
    table.insert(out, ARGV[i])
  end
end
return out
