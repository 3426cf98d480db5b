"""The slot arena's invariants without a daemon: a slot belongs to one lease (of one tenant)
at a time and serves one request at a time, every hand-over bumps its generation, stale and
forged references fail with their kind, a busy lease is reclaimed only once its copies end;
and the shared-memory files of live daemons are never taken for orphans."""

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
    a, b = arena.lease(4, "alice"), arena.lease(4, "alice")
    assert not set(a.slots) & set(b.slots)
    with pytest.raises(SlotError) as info:
        arena.lease(1, "alice")
    assert info.value.kind == "exhausted"
    ref = (a.lease_id, a.slots[0], arena.generation(a.slots[0]))
    with arena.using([ref], 4096, "alice") as (view,):
        view[:3] = b"abc"
    cases = {
        "stale": [(a.lease_id + 1, a.slots[0], ref[2]), (a.lease_id, a.slots[0], ref[2] + 1)],
        "forged": [(a.lease_id, b.slots[0], arena.generation(b.slots[0]))],
        "range": [(a.lease_id, 99, 0), (a.lease_id, a.slots[0], ref[2])],
    }
    for kind, refs in cases.items():
        for r in refs:
            with pytest.raises(SlotError) as info:
                with arena.using([r], 4097 if r == ref else 10, "alice"):
                    pass
            assert info.value.kind == kind
    with pytest.raises(SlotError) as info:  # another tenant may not use, renew or release alice's lease
        with arena.using([ref], 10, "mallory"):
            pass
    assert info.value.kind == "stale"
    with pytest.raises(SlotError):
        arena.renew(a.lease_id, "mallory")
    arena.release(a.lease_id, "mallory")
    with arena.using([ref], 10, "alice"):
        pass
    arena.release(a.lease_id, "alice")
    with pytest.raises(SlotError) as info:
        with arena.using([ref], 10, "alice"):
            pass
    assert info.value.kind == "stale"
    c = arena.lease(4, "alice")  # gets a's slots back, at new generations
    assert set(c.slots) == set(a.slots) and arena.generation(a.slots[0]) > ref[2]


def test_unused_leases_expire_but_not_while_busy(arena):
    a, b = arena.lease(2, "t"), arena.lease(2, "t")
    ref = (b.lease_id, b.slots[0], arena.generation(b.slots[0]))
    with arena.using([ref], 10, "t"):
        time.sleep(0.3)
        assert arena.expire() == 1  # a expired; b is busy
    assert arena.free_slots == 8 - 2
    with pytest.raises(SlotError):
        arena.renew(a.lease_id, "t")
    arena.renew(b.lease_id, "t")


def test_a_slot_serves_one_request_at_a_time(arena):
    """Finding #4(c): two requests naming one slot at once were both accepted."""
    a = arena.lease(2, "t")
    ref = (a.lease_id, a.slots[0], arena.generation(a.slots[0]))
    with arena.using([ref], 10, "t"):
        for refs in ([ref], [(a.lease_id, a.slots[1], arena.generation(a.slots[1])), ref]):
            with pytest.raises(SlotError) as info:
                with arena.using(refs, 10, "t"):
                    pass
            assert info.value.kind == "busy"
    with arena.using([ref], 10, "t"):  # free again once the first request is done
        pass
    with pytest.raises(SlotError) as info:
        with arena.using([ref, ref], 10, "t"):
            pass
    assert info.value.kind == "busy"


def test_a_lease_released_while_busy_comes_back_when_its_copy_ends(arena):
    a = arena.lease(4, "t")
    ref = (a.lease_id, a.slots[0], arena.generation(a.slots[0]))
    with arena.using([ref], 10, "t"):
        arena.release(a.lease_id, "t")
        assert arena.free_slots == 4  # not yet: the daemon may still be writing into the slot
        with pytest.raises(SlotError):
            arena.renew(a.lease_id, "t")
    assert arena.free_slots == 8


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
                    lease = arena.lease(n, "t")
                except SlotError:
                    continue
                held[lease.lease_id] = list(lease.slots)
            elif held:
                arena.release(next(iter(held)), "t")
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


def test_a_lease_is_released_by_the_request_that_asked_for_it(arena):
    """A client whose Lease reply was lost names the request it sent; another tenant cannot."""
    lease = arena.lease(4, "alice", request_id=77)
    arena.release_request(77, "bob")
    assert arena.free_slots == 4
    arena.release_request(77, "alice")
    assert arena.free_slots == 8 and lease.lease_id not in arena._leases


def test_a_lease_request_released_before_it_came_is_refused_then_forgotten(arena):
    arena.release_request(5, "alice")
    with pytest.raises(SlotError) as info:
        arena.lease(2, "alice", request_id=5)
    assert info.value.kind == "abandoned" and arena.free_slots == 8
    arena.lease(2, "bob", request_id=5).lease_id  # another tenant's request of the same number
    time.sleep(2 * arena.lease_ttl_s)  # the arena's own clock: a released request is kept two lifetimes
    assert arena.lease(2, "alice", request_id=5).slots
