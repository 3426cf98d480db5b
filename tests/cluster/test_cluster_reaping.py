"""A member taken for dead while it still wrote (its heartbeat stalled:
a long GC pause, a stopped VM) deleted another member's acknowledged durable value.

Member a reserves a chunk and stalls before its write lands; b reaps it (a's unfinished
write is removed and uncounted), then b puts the same chunk durably: reserved, written,
committed, acknowledged. a wakes up: its write lands (the same bytes: keys name content),
its commit fails (the entry is b's now), and BudgetedTier._undo deletes the value under the
key, since its header is "ours". That value is b's acknowledged durable copy, and the
ledger keeps counting it resident. docs/cluster.md ("No fencing") accepts that the late
value goes uncounted; not that another member's acknowledged value goes. Real Redis."""

import threading

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

import redis  # noqa: E402

from cluster_faults import quick_reaping  # noqa: E402
from faults import Call, FaultyTier, Gate, wait_until  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import chunks, redis_member  # noqa: E402


def test_a_member_reaped_mid_write_leaves_the_value_another_member_put_durably(tmp_path, redis_server):
    keys, values = chunks(1, seed=71)
    key, value = keys[0], values[0]
    ca = quick_reaping(redis_member(tmp_path, redis_server.url, "rv-reaped", "a"))
    cb = quick_reaping(redis_member(tmp_path, redis_server.url, "rv-reaped", "b"))
    raw = redis.Redis.from_url(redis_server.url)
    rkey = ca.redis.key_prefix.encode() + key.id.hex().encode()
    with Store(ca) as a, Store(cb) as b:
        awake = threading.Event()
        beat = a.cluster.ledger.beat
        stalled = [False]

        def stalling_beat(*args):  # a's heartbeat thread stalls, as in a long pause of the process
            if stalled[0]:
                awake.wait()
            return beat(*args)

        a.cluster.ledger.beat = stalling_beat
        budgeted = a.tier("redis")
        faulty = budgeted.inner = FaultyTier(budgeted.inner)
        gate = faulty.gates["write"] = Gate(key.id)
        try:
            stalled[0] = True
            putting = Call(lambda: a.put(key, value, durable=True))
            assert gate.entered.wait(10)  # reserved; its SET not sent yet
            ledger = b.cluster.ledger

            def reaped():
                state = ledger.state(0.5)
                a_live = next(m.live for m in state.members if m.name == "a")
                return not a_live and state.tiers["redis"].chunks == 0
            wait_until(reaped, what="b's heartbeat reaping a's unfinished write")
            b.put(key, value, durable=True)  # acknowledged: committed by b
            assert raw.exists(rkey)
        finally:
            stalled[0] = False
            awake.set()
            gate.open()  # a wakes up: its write lands, its commit fails
        try:
            putting.outcome()
        except Exception:
            pass  # a's put fails: it was taken for dead meanwhile
        on_redis = raw.exists(rkey)
        usage = ledger.state(10.0).tiers["redis"]
        counted = (usage.chunks, usage.used_bytes)
        held = (1, raw.strlen(rkey)) if on_redis else (0, 0)
    assert on_redis == 1, "b's acknowledged durable value was deleted by the undo of a's late write"
    assert counted == held
