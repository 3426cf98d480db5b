"""The slot arena's invariants without a daemon: a slot belongs to one lease at a time, every
hand-over bumps its generation, stale and forged references fail with their kind, a busy
lease never expires."""

import time

import pytest
from hypothesis import given, settings, strategies as st

from kvstore.daemon.slots import SlotArena, SlotError
from kvstore.wire.frames import NONCE_BYTES


@pytest.fixture
def arena(tmp_path):
    a = SlotArena(str(tmp_path), slots=8, slot_bytes=4096, lease_ttl_s=0.2, max_slots_per_lease=4)
    yield a
    a.close()


def test_arena_file_is_private_and_starts_with_the_nonce(arena):
    import os
    import stat

    assert stat.S_IMODE(os.stat(arena.path).st_mode) == 0o600
    with open(arena.path, "rb") as f:
        assert f.read(NONCE_BYTES) == arena.nonce


def test_leases_never_share_a_slot_and_references_are_checked(arena):
    a, b = arena.lease(4), arena.lease(4)
    assert not set(a.slots) & set(b.slots)
    with pytest.raises(SlotError) as info:
        arena.lease(1)
    assert info.value.kind == "exhausted"
    ref = (a.lease_id, a.slots[0], arena.generation(a.slots[0]))
    with arena.using([ref], 4096) as (view,):
        view[:3] = b"abc"
    cases = {
        "stale": [(a.lease_id + 1, a.slots[0], ref[2]), (a.lease_id, a.slots[0], ref[2] + 1)],
        "forged": [(a.lease_id, b.slots[0], arena.generation(b.slots[0]))],
        "range": [(a.lease_id, 99, 0), (a.lease_id, a.slots[0], ref[2])],
    }
    for kind, refs in cases.items():
        for r in refs:
            with pytest.raises(SlotError) as info:
                with arena.using([r], 4097 if r == ref else 10):
                    pass
            assert info.value.kind == kind
    arena.release(a.lease_id)
    with pytest.raises(SlotError) as info:
        with arena.using([ref], 10):
            pass
    assert info.value.kind == "stale"
    c = arena.lease(4)  # gets a's slots back, at new generations
    assert set(c.slots) == set(a.slots) and arena.generation(a.slots[0]) > ref[2]


def test_unused_leases_expire_but_not_while_busy(arena):
    a, b = arena.lease(2), arena.lease(2)
    ref = (b.lease_id, b.slots[0], arena.generation(b.slots[0]))
    with arena.using([ref], 10):
        time.sleep(0.3)
        assert arena.expire() == 1  # a expired; b is busy
    assert arena.free_slots == 8 - 2
    with pytest.raises(SlotError):
        arena.renew(a.lease_id)
    arena.renew(b.lease_id)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["lease", "release"]), st.integers(1, 4)), max_size=30))
def test_random_lease_sequences_keep_slots_exclusive(tmp_path_factory, ops):
    arena = SlotArena(str(tmp_path_factory.mktemp("arena")), slots=8, slot_bytes=4096, lease_ttl_s=60,
                      max_slots_per_lease=4)
    held = {}
    try:
        for op, n in ops:
            if op == "lease":
                try:
                    lease = arena.lease(n)
                except SlotError:
                    continue
                held[lease.lease_id] = list(lease.slots)
            elif held:
                arena.release(next(iter(held)))
                held.pop(next(iter(held)))
            owned = [s for slots in held.values() for s in slots]
            assert len(owned) == len(set(owned)) and arena.free_slots == 8 - len(owned)
    finally:
        arena.close()


def test_host_pool_is_shared_only_where_the_shm_directory_has_room(tmp_path):
    from fsfaults import tiny_tmpfs
    from kvstore.daemon.config import DaemonConfig
    from kvstore.daemon.server import Daemon

    config = DaemonConfig()
    config.store.host.capacity_bytes = 64 << 20
    config.shm.dir = str(tmp_path)
    path = Daemon(config)._store_config().host.shm_path
    assert path is not None and path.startswith(str(tmp_path / "kvstore-pool-"))
    with tiny_tmpfs(tmp_path / "tiny", 32 << 20) as tiny:
        config.shm.dir = str(tiny)
        assert Daemon(config)._store_config().host.shm_path is None  # 64 MiB would not fit: private memory
    config.shm.share_host_pool = False
    config.shm.dir = str(tmp_path)
    assert Daemon(config)._store_config().host.shm_path is None
