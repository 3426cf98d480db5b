"""A plain re-put over a peer's blob of the same codec and size on a shared PFS directory.

A puts a chunk and its copy reaches the PFS; B puts the chunk too, with other bytes of the
same codec and size, and its file replaces A's; then A puts its chunk again. A's index still
listed its PFS copy as current, so the re-put queued no copy there (only a durable put's
copy looked at the medium): once A's host copy was gone its read of the PFS was a miss,
though the put had succeeded. A re-put's copy to a shared tier where the index lists the
chunk's blob now peeks the medium's header and writes its own unless it is that blob; a
first copy does not look."""

from __future__ import annotations

import threading

import pytest

from kvstore.store import write_behind
from kvstore.store import Store
from kvstore.store.deletes import peek_header
from pfs_peers import daemon, two_puts
from shared_tiers import chunks


@pytest.mark.parametrize("replication", ["all", "utility"])
@pytest.mark.parametrize("host_copy", ["kept", "dropped"])
@pytest.mark.parametrize("kind", ["raw", "mixed"])
def test_a_plain_re_put_over_a_peers_blob_of_the_same_size_writes_its_own(tmp_path, kind, host_copy, replication):
    """``host_copy``: whether A's host RAM still holds the chunk when it puts it again (a
    put of what is there, or a new first-tier copy of the same version); ``replication``:
    the planner's copies leave out tiers that hold one, the look at the PFS's is added."""
    keys, values = chunks(1, seed=23)
    key = keys[0]
    mine, my_codec, theirs, their_codec = two_puts(kind, values[0])
    config = daemon(tmp_path, None, "raw")
    config.replication.mode = replication
    with Store(config) as a:
        a.put(key, mine, codec=my_codec)
        assert a.flush(timeout_s=30)
        a_blob = a.get_blob(key)
        with Store(daemon(tmp_path, None, "raw")) as b:
            b.put(key, theirs, codec=their_codec)  # its copy replaces A's file on the PFS once B closes
            b_blob = b.get_blob(key)
        assert b_blob != a_blob and len(b_blob) == len(a_blob), "not another blob of the same size"
        if host_copy == "dropped":
            assert a.drop(keys, "host") == 1
        a.put(key, mine, codec=my_codec)
        assert a.flush(timeout_s=30)
        assert a.drop(keys, "host") == 1  # A's index lists its PFS copy alone
        assert a.get_blob(key) == a_blob, "A's put is not on the PFS, though its index lists it there"
        a.check_integrity()


@pytest.mark.parametrize("host_copy", ["kept", "dropped"])
def test_a_plain_re_put_over_its_own_blob_looks_once_and_writes_nothing(tmp_path, monkeypatch, host_copy):
    """The first copy does not look at the PFS; the re-put's finds its own blob there and
    leaves it."""
    peeks = []

    def counted(tier, key_id):
        peeks.append(tier.name)
        return peek_header(tier, key_id)

    monkeypatch.setattr(write_behind, "peek_header", counted)
    keys, values = chunks(1, seed=24)
    key = keys[0]
    with Store(daemon(tmp_path, None, "raw")) as a:
        a.put(key, values[0])
        assert a.flush(timeout_s=30)
        assert peeks == []
        written = a.stats().tiers["pfs"].bytes_written
        if host_copy == "dropped":
            assert a.drop(keys, "host") == 1
        a.put(key, values[0])
        assert a.flush(timeout_s=30)
        assert peeks == ["pfs"]
        assert a.stats().tiers["pfs"].bytes_written == written
        assert a.drop(keys, "host") == 1
        assert a.get_blob(key) is not None


def test_a_plain_re_put_of_what_is_there_does_not_wait_for_a_full_queue(tmp_path, monkeypatch):
    """The look at the PFS copy is behind and best effort: with the PFS queue full (a copy
    under way, the stall limit far off) the re-put is an access and returns at once. (It
    waited for room, up to the stall limit, in the version that first queued the look.)"""
    keys, values = chunks(2, seed=29)
    config = daemon(tmp_path, None, "raw")
    config.write_behind.stall_s = 120.0
    held, release = threading.Event(), threading.Event()
    copy = write_behind.WriteBehind._copy

    def blocked(self, q, job):
        if held.is_set():
            release.wait(60)
        return copy(self, q, job)

    monkeypatch.setattr(write_behind.WriteBehind, "_copy", blocked)
    with Store(config) as a:
        a.put(keys[0], values[0])
        assert a.flush(timeout_s=30)
        a._write_behind.max_pending_bytes = len(a.get_blob(keys[0]))  # room for one copy
        held.set()
        a.put(keys[1], values[1])  # its copy holds the PFS queue's room
        re_put = threading.Thread(target=a.put, args=(keys[0], values[0]))
        re_put.start()
        re_put.join(timeout=30)
        finished = not re_put.is_alive()
        release.set()
        re_put.join()
        assert finished, "a plain re-put of a chunk in host RAM waited for the PFS queue"
        assert a.flush(timeout_s=30)
        a.check_integrity()
