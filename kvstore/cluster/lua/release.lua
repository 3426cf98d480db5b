-- ARGV: prefix, member, tier, own_only, keys... The values are gone: their bytes stop
-- counting (with own_only '1', only entries this member writes: undoing a failed write).
local m, T, own = ARGV[2], ARGV[3], ARGV[4] == '1'
for i = 5, #ARGV do
  local v = redis.call('HGET', P .. 't:' .. T, ARGV[i])
  if v and not (own and string.match(v, '^p %d+ %d+ (.*)$') ~= m) then drop_entry(T, ARGV[i]) end
end
return used(T)
