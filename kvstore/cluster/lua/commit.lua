-- ARGV: prefix, member, tier, key. Returns 1 if the write stays (0: the entry was taken from
-- this member meanwhile: a delete, or it was reaped as dead; the caller removes the value).
-- Run again (redis-py retries a command whose reply was lost), it answers 1 again: the entry
-- this member's reservation made pending is resident and still its own.
local m, T, key = ARGV[2], ARGV[3], ARGV[4]
local v = redis.call('HGET', P .. 't:' .. T, key)
if not v then return 0 end
local s, fp, size, owner = parse(v)
if s == 'r' and owner == m then return 1 end
if s ~= 'p' or owner ~= m then return 0 end
redis.call('HSET', P .. 't:' .. T, key, 'r ' .. fp .. ' ' .. size .. ' ' .. m)
redis.call('SREM', P .. 'f:' .. T .. ':' .. m, key)
redis.call('ZADD', P .. 'q:' .. T .. ':' .. m, redis.call('INCR', P .. 'seq'), key)
return 1
