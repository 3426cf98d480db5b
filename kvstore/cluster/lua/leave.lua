-- ARGV: prefix, member, info json (kept, marked left). The member stops counting at once.
redis.call('ZADD', P .. 'beats', 0, ARGV[2])
redis.call('HSET', P .. 'info', ARGV[2], ARGV[3])
redis.call('DEL', P .. 'pins:' .. ARGV[2])
return 1
