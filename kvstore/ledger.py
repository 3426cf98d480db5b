"""The cluster ledger: what every daemon sharing the pfs and redis tiers must agree on, kept
in the shared index's Redis (docs/cluster.md).

Per shared tier: its budget, the bytes used against it (in total and per member), and one
entry per chunk on it (state, footprint, size, owner). Per member: a heartbeat and its pins,
each with an expiry. Every change is one Lua script, so it is atomic, and the scripts use
the server's clock, so members need no synchronised clocks.

Why one hash slot: a check and its update ("does this fit the budget? then count it") must
be one atomic step, and a Redis Cluster runs a script only on keys of one slot. Every key
here carries the hash tag ``{<prefix>cluster}``: the ledger lives on one primary (and its
replicas) while the per-chunk lookup index stays spread over all nodes.

A chunk entry's states: ``p`` (pending: its owner writes it now), ``r`` (resident:
written, counted, a candidate for eviction in its owner's FIFO), ``e`` (evicting: a member
deletes its value now). Bytes count from the reservation until the value is gone, so the
values on a tier never take more than its budget. A member silent for ``member_ttl_s`` is
dead: its pins stop counting at once, and its unfinished writes and deletes are finished
(their values removed) by whichever member reaps it.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Sequence

from tiers.redis import REDIS_DOWN, connect, unavailable_on_failure

_COMMON = r"""
local P = ARGV[1]
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function parse(v)
  local s, fp, size, owner = string.match(v, '^(%a) (%d+) (%d+) (.*)$')
  return s, tonumber(fp), tonumber(size), owner
end
-- The time, and the oldest heartbeat of a live member. When nobody reached the ledger for
-- half a member_ttl (its primary failed over, Redis restarted), every member was cut off
-- alike: for one member_ttl, every member that has not left counts as live.
local function clock(ttl)
  local now = now_ms()
  local seen = tonumber(redis.call('GET', P .. 'seen') or '0')
  if seen > 0 and now - seen > ttl / 2 then redis.call('SET', P .. 'grace', now + ttl) end
  redis.call('SET', P .. 'seen', now)
  if now < tonumber(redis.call('GET', P .. 'grace') or '0') then return now, 1 end
  return now, now - ttl
end
local function is_live(m, alive_after)
  local beat = redis.call('ZSCORE', P .. 'beats', m)
  return beat ~= false and tonumber(beat) >= alive_after
end
-- A zero delta is skipped: Lua writes the -0 of a 0-byte entry dropped as "-0", which HINCRBY refuses
local function add_used(T, m, delta)
  if delta == 0 then return end
  redis.call('HINCRBY', P .. 'used', T, delta)
  if redis.call('HINCRBY', P .. 'u:' .. T, m, delta) == 0 then
    redis.call('HDEL', P .. 'u:' .. T, m)
  end
end
local function used(T)
  return tonumber(redis.call('HGET', P .. 'used', T) or '0')
end
local function drop_entry(T, key)
  local v = redis.call('HGET', P .. 't:' .. T, key)
  if not v then return end
  local s, fp, size, owner = parse(v)
  redis.call('HDEL', P .. 't:' .. T, key)
  redis.call('ZREM', P .. 'q:' .. T .. ':' .. owner, key)
  redis.call('SREM', P .. 'f:' .. T .. ':' .. owner, key)
  add_used(T, owner, -fp)
end
"""

# ARGV: prefix, member, info json, then tier/budget pairs. Returns {'ok', keys to remove...}
# (the previous incarnation's unfinished writes, now this member's to delete) or
# {'budget', tier, the cluster's budget} when a budget differs.
_JOIN = _COMMON + r"""
local m = ARGV[2]
for i = 4, #ARGV, 2 do
  local T, b = ARGV[i], ARGV[i + 1]
  redis.call('HSETNX', P .. 'budget', T, b)
  local have = redis.call('HGET', P .. 'budget', T)
  if have ~= b then return {'budget', T, have} end
end
redis.call('ZADD', P .. 'beats', now_ms(), m)
redis.call('HSET', P .. 'info', m, ARGV[3])
redis.call('DEL', P .. 'pins:' .. m)
local out = {'ok'}
for i = 4, #ARGV, 2 do
  local T = ARGV[i]
  for _, key in ipairs(redis.call('SMEMBERS', P .. 'f:' .. T .. ':' .. m)) do
    local v = redis.call('HGET', P .. 't:' .. T, key)
    if v then
      local s, fp, size, owner = parse(v)
      redis.call('HSET', P .. 't:' .. T, key, 'e ' .. fp .. ' ' .. size .. ' ' .. owner)
      table.insert(out, T .. ' ' .. key)
    else
      redis.call('SREM', P .. 'f:' .. T .. ':' .. m, key)
    end
  end
end
return out
"""

# ARGV: prefix, member, info json, member_ttl_ms, forget_after_ms, token, then the tiers this
# member mounts (none: every tier). Beats, drops dead members' pins and hands this member
# their unfinished writes and deletes on its tiers: returns {'tier key', ...} to delete (then
# ``evicted``). Work on a tier it lacks stays the dead member's, for a member with the tier
# (taken, it stayed evicting in this member's set for good), and keeps the dead member known. What it hands is kept under the call's token
# for an hour: run again with the same token (redis-py's retry of a lost reply, or the next
# beat after a failed one), it answers those of them still this member's to delete. Without
# it a lost reply left them evicting in this member's set, which nothing would ever delete
# while the member lived: bytes counted for good, the chunks busy to every writer.
_BEAT = _COMMON + r"""
local m, ttl, forget = ARGV[2], tonumber(ARGV[4]), tonumber(ARGV[5])
local memo = P .. 'reap:' .. ARGV[6]
local now, alive_after = clock(ttl)
redis.call('ZADD', P .. 'beats', now, m)
redis.call('HSET', P .. 'info', m, ARGV[3])
redis.call('ZREMRANGEBYSCORE', P .. 'pins:' .. m, '-inf', now)
local out = {}
if redis.call('EXISTS', memo) == 1 then
  for _, item in ipairs(redis.call('LRANGE', memo, 0, -1)) do
    local T, key = string.match(item, '^(%S+) (%S+)$')
    local v = redis.call('HGET', P .. 't:' .. T, key)
    if v and string.sub(v, 1, 1) == 'e' and redis.call('SISMEMBER', P .. 'f:' .. T .. ':' .. m, key) == 1 then
      table.insert(out, item)
    end
  end
  return out
end
local tiers = redis.call('HKEYS', P .. 'budget')
local mounted = {}
for i = 7, #ARGV do mounted[ARGV[i]] = true end
if #ARGV < 7 then for _, T in ipairs(tiers) do mounted[T] = true end end
for _, d in ipairs(redis.call('ZRANGEBYSCORE', P .. 'beats', '-inf', '(' .. alive_after)) do
  redis.call('DEL', P .. 'pins:' .. d)
  local holds = false
  for _, T in ipairs(tiers) do
    local fset = P .. 'f:' .. T .. ':' .. d
    for _, key in ipairs(mounted[T] and redis.call('SMEMBERS', fset) or {}) do
      local v = redis.call('HGET', P .. 't:' .. T, key)
      redis.call('SREM', fset, key)
      if v then
        local s, fp, size, owner = parse(v)
        if s ~= 'r' then
          redis.call('HSET', P .. 't:' .. T, key, 'e ' .. fp .. ' ' .. size .. ' ' .. owner)
          redis.call('SADD', P .. 'f:' .. T .. ':' .. m, key)
          table.insert(out, T .. ' ' .. key)
          redis.call('RPUSH', memo, T .. ' ' .. key)
        end
      end
    end
    if redis.call('HEXISTS', P .. 'u:' .. T, d) == 1 or redis.call('SCARD', fset) > 0 then holds = true end
  end
  if not holds and tonumber(redis.call('ZSCORE', P .. 'beats', d)) < now - forget then
    redis.call('ZREM', P .. 'beats', d)
    redis.call('HDEL', P .. 'info', d)
  end
end
if #out > 0 then redis.call('PEXPIRE', memo, 3600000) end
return out
"""

# ARGV: prefix, member, info json (kept, marked left). The member stops counting at once.
_LEAVE = _COMMON + r"""
redis.call('ZADD', P .. 'beats', 0, ARGV[2])
redis.call('HSET', P .. 'info', ARGV[2], ARGV[3])
redis.call('DEL', P .. 'pins:' .. ARGV[2])
return 1
"""

# ARGV: prefix, member, tier, key, footprint, size, member_ttl_ms, take. Returns {answer, used}:
# ok (reserved, pending: write, then commit), present (the same value is there: nothing to
# write), busy (another member writes or deletes it now: ask again), full (no room). With
# take '1', a resident entry is taken over as if it were absent (its value is gone from the
# medium: Redis dropped it on its own, somebody removed the file).
_RESERVE = _COMMON + r"""
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
"""

# ARGV: prefix, member, tier, key. Returns 1 if the write stays (0: the entry was taken from
# this member meanwhile: a delete, or it was reaped as dead; the caller removes the value).
# Run again (redis-py retries a command whose reply was lost), it answers 1 again: the entry
# this member's reservation made pending is resident and still its own.
_COMMIT = _COMMON + r"""
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
"""

# ARGV: prefix, member, tier, own_only, keys... The values are gone: their bytes stop
# counting (with own_only '1', only entries this member writes: undoing a failed write).
_RELEASE = _COMMON + r"""
local m, T, own = ARGV[2], ARGV[3], ARGV[4] == '1'
for i = 5, #ARGV do
  local v = redis.call('HGET', P .. 't:' .. T, ARGV[i])
  if v and not (own and string.match(v, '^p %d+ %d+ (.*)$') ~= m) then drop_entry(T, ARGV[i]) end
end
return used(T)
"""

# ARGV: prefix, member, tier, keys... This member deletes these values now: it takes each
# key's entry until ``evicted``, as make_room takes its victims, so that no reservation of the
# key is granted meanwhile. A resident entry becomes evicting (a reservation is answered busy,
# not "present" for a value about to be gone); so does a pending one (its writer's commit
# answers 0: the value it may have written before the delete is gone, and it undoes its
# write), which also leaves its writer's set of entries in flight: exactly one member holds
# an evicting entry (left in both, the writer reaped or restarted was handed it too, and
# dropped it while this member still deleted: a durable put of the key granted and committed
# then lost its value to this delete). A key with no entry gets a 0-byte evicting one (a
# reservation granted between this and the delete would have its value deleted, and could
# be committed first). An entry another member evicts now stays that member's to drop.
_DELETING = _COMMON + r"""
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
"""

# ARGV: prefix, member, tier, key, token. This member undoes a write of the key that was not
# committed: it takes the key's entry, as ``deleting`` does, but only where no other member's
# value can be under the key: no entry (the write's was taken and dropped since), or this
# member's own pending one. Returns 'mine' (taken, evicting: delete the value, then
# ``evicted``), 'kept' (a resident or pending entry another member holds, or this member's
# committed one: the value is that one's, never deleted by the undo) or 'busy' (a member
# deletes or evicts it now: ask again later). A 'mine' is kept under the token for an hour, so
# a retry of a call whose reply was lost answers 'mine' again instead of 'busy', while the
# entry is still this member's to delete: taken from it since (it was reaped as dead), the
# undo is its reaper's, and the key may hold another member's value by now ('kept').
_UNDOING = _COMMON + r"""
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
"""

# ARGV: prefix, member, tier, keys... This member finished deleting them (state e). Only the
# entries it took (in its set) are dropped: one another member evicts or deletes now is that
# member's to drop once its value is gone, or a reservation granted before would see its
# value deleted after its commit.
_EVICTED = _COMMON + r"""
local m, T = ARGV[2], ARGV[3]
for i = 4, #ARGV do
  local key = ARGV[i]
  if redis.call('SREM', P .. 'f:' .. T .. ':' .. m, key) == 1 then
    local v = redis.call('HGET', P .. 't:' .. T, key)
    if v and string.sub(v, 1, 1) == 'e' then drop_entry(T, key) end
  end
end
return used(T)
"""

# ARGV: prefix, member, tier, keys... Those of the keys this member is to delete now (state
# e, in its set): a delete of them that failed is this member's to finish.
_MINE_TO_DELETE = _COMMON + r"""
local m, T = ARGV[2], ARGV[3]
local out = {}
for i = 4, #ARGV do
  local v = redis.call('HGET', P .. 't:' .. T, ARGV[i])
  if v and string.sub(v, 1, 1) == 'e' and redis.call('SISMEMBER', P .. 'f:' .. T .. ':' .. m, ARGV[i]) == 1 then
    table.insert(out, ARGV[i])
  end
end
return out
"""

# ARGV: prefix, member, tier, need, member_ttl_ms, max_victims, token. Returns {'ok', used} when
# ``need`` bytes are free, {'full', used} when nothing can go, else {'evict', used, keys...}:
# chunks this member must delete now (then ``evicted``), taken from the member furthest
# above its fair share (budget / live members; a dead member's share is 0), oldest first,
# skipping every chunk a live member pins. An 'evict' answer is kept under its call's token
# for an hour: run again with the same token (redis-py retries a command whose reply was
# lost), the script answers the same victims instead of choosing more, and a member that
# lost both replies asks for them by the token (``_ROOM_VICTIMS``).
_MAKE_ROOM = _COMMON + r"""
local m, T, need, ttl, most = ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local memo = P .. 'room:' .. ARGV[7]
if redis.call('EXISTS', memo) == 1 then return redis.call('LRANGE', memo, 0, -1) end
local budget = tonumber(redis.call('HGET', P .. 'budget', T))
local u = used(T)
if budget - u >= need then return {'ok', u} end
local want = need - (budget - u)
local now, alive_after = clock(ttl)
local live = redis.call('ZRANGEBYSCORE', P .. 'beats', alive_after, '+inf')
local share = budget / math.max(#live, 1)
local is_live_m = {}
for _, x in ipairs(live) do is_live_m[x] = true end
local by = {}
local flat = redis.call('HGETALL', P .. 'u:' .. T)
for i = 1, #flat, 2 do
  local over = tonumber(flat[i + 1]) - (is_live_m[flat[i]] and share or 0)
  table.insert(by, {flat[i], over})
end
table.sort(by, function(a, b) return a[2] > b[2] end)
local function pinned(key)
  for _, x in ipairs(live) do
    local until_ms = redis.call('ZSCORE', P .. 'pins:' .. x, key)
    if until_ms and tonumber(until_ms) > now then return true end
  end
  return false
end
-- at most 4096 chunks looked at per call, pinned ones included: Redis runs nothing else meanwhile
local out, freed, scanned = {'evict', u}, 0, 0
for _, cand in ipairs(by) do
  local q = P .. 'q:' .. T .. ':' .. cand[1]
  local start = 0
  while freed < want and #out - 2 < most and scanned < 4096 do
    local batch = redis.call('ZRANGE', q, start, start + 63)
    if #batch == 0 then break end
    scanned = scanned + #batch
    local kept = 0
    for _, key in ipairs(batch) do
      if freed >= want or #out - 2 >= most then break end
      if pinned(key) then
        kept = kept + 1
      else
        local s, fp, size, owner = parse(redis.call('HGET', P .. 't:' .. T, key))
        redis.call('HSET', P .. 't:' .. T, key, 'e ' .. fp .. ' ' .. size .. ' ' .. owner)
        redis.call('ZREM', q, key)
        redis.call('SADD', P .. 'f:' .. T .. ':' .. m, key)
        table.insert(out, key)
        freed = freed + fp
      end
    end
    start = start + kept
  end
  if freed >= want or #out - 2 >= most or scanned >= 4096 then break end
end
if #out == 2 then return {'full', u} end
redis.call('RPUSH', memo, unpack(out))
redis.call('PEXPIRE', memo, 3600000)
return out
"""

# ARGV: prefix, token. The victims of the make_room call with that token (then forgotten).
_ROOM_VICTIMS = _COMMON + r"""
local memo = P .. 'room:' .. ARGV[2]
local out = redis.call('LRANGE', memo, 2, -1)
redis.call('DEL', memo)
return out
"""

# ARGV: prefix, member, member_ttl_ms, keys... (pin) / prefix, member, keys... (unpin)
_PIN = _COMMON + r"""
local m, ttl = ARGV[2], tonumber(ARGV[3])
local until_ms = now_ms() + ttl
for i = 4, #ARGV do redis.call('ZADD', P .. 'pins:' .. m, 'GT', until_ms, ARGV[i]) end
return until_ms
"""

_NOW = _COMMON + "return now_ms()"


class BudgetMismatch(ValueError):
    """This daemon's budget for a shared tier is not the cluster's."""


@dataclass
class TierUsage:
    budget_bytes: int
    used_bytes: int
    chunks: int
    by_member: dict[str, int] = field(default_factory=dict)
    in_flight: int = 0


@dataclass
class MemberState:
    name: str
    heartbeat_age_s: float | None  # None: left cleanly
    live: bool
    pins: int
    info: dict


@dataclass
class ClusterState:
    tiers: dict[str, TierUsage]
    members: list[MemberState]


class Ledger:
    """The scripts above, bound to one Redis (standalone or Cluster) and one key prefix."""

    def __init__(self, url: str, key_prefix: str, cluster: bool, socket_timeout_s: float = 1.0,
                 connect_timeout_s: float = 0.5, max_connections: int = 8) -> None:
        self.prefix = "{" + key_prefix + "cluster}:"
        self._cluster = cluster
        self._tag = self.prefix + "tag"  # routes every script to the ledger's slot
        self._client = connect(url, cluster, socket_timeout_s, connect_timeout_s, max_connections)
        scripts = dict(join=_JOIN, beat=_BEAT, leave=_LEAVE, reserve=_RESERVE, commit=_COMMIT, release=_RELEASE,
                       deleting=_DELETING, undoing=_UNDOING, evicted=_EVICTED, mine_to_delete=_MINE_TO_DELETE,
                       make_room=_MAKE_ROOM, room_victims=_ROOM_VICTIMS, pin=_PIN, now=_NOW)
        self._scripts = {name: self._client.register_script(code) for name, code in scripts.items()}

    def _call(self, name: str, *args) -> object:
        with unavailable_on_failure(f"cluster ledger: {name}"):
            return self._scripts[name](keys=[self._tag], args=[self.prefix, *args])

    @staticmethod
    def _str(value) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    def _pairs(self, answer) -> list[tuple[str, bytes]]:
        """``'tier keyhex'`` strings as (tier, key id)."""
        out = []
        for item in answer:
            tier, key = self._str(item).split(" ")
            out.append((tier, bytes.fromhex(key)))
        return out

    # -- membership ------------------------------------------------------------------------------

    def join(self, member: str, budgets: dict[str, int], info: dict) -> list[tuple[str, bytes]]:
        """Become a member; raises BudgetMismatch if a budget differs from the cluster's.
        Returns the (tier, key) values this member's previous run left half-written."""
        args = [member, json.dumps(info)]
        for tier, budget in budgets.items():
            args += [tier, str(int(budget))]
        answer = self._call("join", *args)
        if self._str(answer[0]) == "budget":
            raise BudgetMismatch(f"{self._str(answer[1])}.capacity_bytes is {budgets[self._str(answer[1])]} bytes "
                                 f"but the cluster's budget for it is {self._str(answer[2])}; every member of a "
                                 f"cluster must configure the same budget (see docs/cluster.md)")
        return self._pairs(answer[1:])

    def beat(self, member: str, info: dict, member_ttl_s: float, forget_after_s: float,
             token: str | None = None, tiers: Sequence[str] = ()) -> list[tuple[str, bytes]]:
        """A heartbeat; returns the (tier, key) values of dead members this member must delete,
        on ``tiers`` (the tiers it mounts; none: every tier). ``token`` names the call: a beat
        after one that failed passes that one's token, so that what it may have handed over is
        answered again rather than lost (``_BEAT``)."""
        answer = self._call("beat", member, json.dumps(info), int(member_ttl_s * 1000), int(forget_after_s * 1000),
                            token or secrets.token_hex(12), *tiers)
        return self._pairs(answer)

    def leave(self, member: str, info: dict) -> None:
        self._call("leave", member, json.dumps({**info, "left": True}))

    # -- the budget -------------------------------------------------------------------------------

    def reserve(self, member: str, tier: str, key_id: bytes, footprint: int, size: int,
                member_ttl_s: float, take: bool = False) -> tuple[str, int]:
        """``take``: the value the ledger lists as resident is gone from the medium; reserve
        it again rather than answer "present"."""
        answer = self._call("reserve", member, tier, key_id.hex(), footprint, size, int(member_ttl_s * 1000),
                            "1" if take else "0")
        return self._str(answer[0]), int(answer[1])

    def holder(self, tier: str, key_id: bytes) -> tuple[str, str] | None:
        """The chunk's entry now: (state, owner), or None if the ledger has none."""
        with unavailable_on_failure("cluster ledger: holder"):
            v = self._client.hget(self.prefix + "t:" + tier, key_id.hex())
        if v is None:
            return None
        state, _, _, owner = self._str(v).split(" ", 3)
        return state, owner

    def commit(self, member: str, tier: str, key_id: bytes) -> bool:
        return bool(self._call("commit", member, tier, key_id.hex()))

    def release(self, member: str, tier: str, key_ids: Sequence[bytes], own_only: bool = False) -> int:
        return int(self._call("release", member, tier, "1" if own_only else "0", *[k.hex() for k in key_ids]))

    def deleting(self, member: str, tier: str, key_ids: Sequence[bytes]) -> int:
        return int(self._call("deleting", member, tier, *[k.hex() for k in key_ids]))

    def undoing(self, member: str, tier: str, key_id: bytes, token: str) -> str:
        """Take the key's entry to undo this member's uncommitted write of it: 'mine', 'kept' or
        'busy' (``_UNDOING``). ``token`` names the undo: the same for every retry of it."""
        return self._str(self._call("undoing", member, tier, key_id.hex(), token))

    def evicted(self, member: str, tier: str, key_ids: Sequence[bytes]) -> int:
        return int(self._call("evicted", member, tier, *[k.hex() for k in key_ids]))

    def mine_to_delete(self, member: str, tier: str, key_ids: Sequence[bytes]) -> list[bytes]:
        """Those of ``key_ids`` that are still this member's to delete (marked evicting by it)."""
        if not key_ids:
            return []
        answer = self._call("mine_to_delete", member, tier, *[k.hex() for k in key_ids])
        return [bytes.fromhex(self._str(k)) for k in answer]

    def make_room(self, member: str, tier: str, need: int, member_ttl_s: float, token: str,
                  max_victims: int = 256) -> tuple[str, int, list[bytes]]:
        """``token`` names this call (a fresh one each), so that a retry of it answers the same
        victims, and they can be asked for if its reply is lost (``room_victims``)."""
        answer = self._call("make_room", member, tier, need, int(member_ttl_s * 1000), max_victims, token)
        return self._str(answer[0]), int(answer[1]), [bytes.fromhex(self._str(k)) for k in answer[2:]]

    def room_victims(self, token: str) -> list[bytes]:
        """The victims of the make_room call named ``token`` whose reply was lost (none if it
        did not run, or answered without victims)."""
        return [bytes.fromhex(self._str(k)) for k in self._call("room_victims", token)]

    # -- pins --------------------------------------------------------------------------------------

    def pin(self, member: str, key_ids: Sequence[bytes], ttl_s: float) -> None:
        if key_ids:
            self._call("pin", member, int(ttl_s * 1000), *[k.hex() for k in key_ids])

    def unpin(self, member: str, key_ids: Sequence[bytes]) -> None:
        if key_ids:
            with unavailable_on_failure("cluster ledger: unpin"):
                self._client.zrem(self.prefix + "pins:" + member, *[k.hex() for k in key_ids])

    # -- reading it all (``kvstore cluster``) ---------------------------------------------------------

    def state(self, member_ttl_s: float) -> ClusterState:
        with unavailable_on_failure("cluster ledger: state"):
            c, p = self._client, self.prefix
            now_ms = int(self._call("now"))  # the ledger node's clock, which the scripts use
            budgets = {self._str(k): int(v) for k, v in c.hgetall(p + "budget").items()}
            used = {self._str(k): int(v) for k, v in c.hgetall(p + "used").items()}
            beats = {self._str(m): s for m, s in c.zrange(p + "beats", 0, -1, withscores=True)}
            infos = {self._str(k): json.loads(v) for k, v in c.hgetall(p + "info").items()}
            tiers = {}
            for tier, budget in budgets.items():
                by_member = {self._str(k): int(v) for k, v in c.hgetall(p + "u:" + tier).items()}
                in_flight = sum(c.scard(f"{p}f:{tier}:{m}") for m in set(beats) | set(by_member))
                tiers[tier] = TierUsage(budget, used.get(tier, 0), c.hlen(p + "t:" + tier), by_member, in_flight)
            members = []
            for name in sorted(set(beats) | set(infos)):
                info = infos.get(name, {})
                beat = beats.get(name)
                age = None if beat is None or info.get("left") else (now_ms - beat) / 1000
                live = age is not None and age <= member_ttl_s
                pins = c.zcount(p + "pins:" + name, now_ms + 1, "+inf") if live else 0
                members.append(MemberState(name, age, live, pins, info))
        return ClusterState(tiers, members)

    def health(self) -> dict:
        """The Redis side: ``{"redis": "ok"}`` for a standalone server; for a Redis Cluster its
        state, live primaries and replicas, failed nodes, and primaries with no live replica
        (one more failure there loses slots)."""
        with unavailable_on_failure("cluster ledger: health"):
            if not self._cluster:
                self._client.ping()
                return {"redis": "ok"}
            state, nodes = self._ask_any_node()
        flags = {addr: set(n["flags"].split(",")) for addr, n in nodes.items()}
        up = {addr for addr, f in flags.items() if not f & {"fail", "fail?", "noaddr"}}
        primaries = {n["node_id"]: addr for addr, n in nodes.items() if "master" in flags[addr] and addr in up and n["slots"]}
        covered = {n["master_id"] for addr, n in nodes.items() if "slave" in flags[addr] and addr in up}
        return {"redis": state, "primaries": len(primaries),
                "replicas": sum(1 for a in up if "slave" in flags[a]),
                "failed": sorted(set(nodes) - up),
                "primaries_without_replica": sorted(a for i, a in primaries.items() if i not in covered)}

    def _ask_any_node(self) -> tuple[str, dict]:
        """CLUSTER INFO and CLUSTER NODES from the first node that answers (a failed node
        cannot say the cluster's state)."""
        error = None
        for node in self._client.get_nodes():
            try:
                info = self._client.cluster_info(target_nodes=node)
                nodes = self._client.execute_command("CLUSTER NODES", target_nodes=node)
                return info.get("cluster_state", "unknown"), nodes
            except REDIS_DOWN as exc:
                error = exc
        raise error

    def close(self) -> None:
        self._client.close()
