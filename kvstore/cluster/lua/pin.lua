-- ARGV: prefix, member, member_ttl_ms, keys... (pin) / prefix, member, keys... (unpin)
local m, ttl = ARGV[2], tonumber(ARGV[3])
local until_ms = now_ms() + ttl
for i = 4, #ARGV do redis.call('ZADD', P .. 'pins:' .. m, 'GT', until_ms, ARGV[i]) end
return until_ms
