-- ARGV: prefix, token. The victims of the make_room call with that token (then forgotten).
local memo = P .. 'room:' .. ARGV[2]
local out = redis.call('LRANGE', memo, 2, -1)
redis.call('DEL', memo)
return out
