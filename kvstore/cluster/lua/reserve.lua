-- ARGV: prefix, member, tier, key, footprint, size, member_ttl_ms, take. Returns {answer, used}:
-- ok (reserved, pending: write, then commit), present (the same value is there: nothing to
-- write), busy (another member writes or deletes it now: ask again), full (no room). With
-- take '1', a resident entry is taken over as if it were absent (its value is gone from the
-- medium: Redis dropped it on its own, somebody removed the file).
local m, T, key, fp, size, ttl = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local take = ARGV[8] == '1'
local budget = tonumber(redis.call('HGET', P .. 'budget', T))
local now, alive_after = clock(ttl)
local v = redis.call('HGET', P .. 't:' .. T, key)
local old_fp, old_owner = 0, nil
if v then
  local s, ofp, osize, owner = parse(v)
  if s == 'e' then return {'busy', used(T)} end
  if s == 'r' and osize == size and not take then return {'present', used(T)} end
  if s == 'p' and owner ~= m and is_live(owner, alive_after) then return {'busy', used(T)} end
  old_fp, old_owner = ofp, owner
end
local after = used(T) - old_fp + fp
if after > budget then return {'full', used(T)} end
if old_owner then
  redis.call('ZREM', P .. 'q:' .. T .. ':' .. old_owner, key)
  redis.call('SREM', P .. 'f:' .. T .. ':' .. old_owner, key)
  add_used(T, old_owner, -old_fp)
end
add_used(T, m, fp)
redis.call('HSET', P .. 't:' .. T, key, 'p ' .. fp .. ' ' .. size .. ' ' .. m)
redis.call('SADD', P .. 'f:' .. T .. ':' .. m, key)
return {'ok', after}
