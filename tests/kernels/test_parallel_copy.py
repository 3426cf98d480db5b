"""kernels/parallel_copy.py: slices cover every byte exactly once, big copies are exact, and a
copy that hashes gives the payload checksum of what it copied."""

import os
import threading
import time
import warnings

import numpy as np
import pytest

from kernels import parallel_copy
from kernels.parallel_copy import SEAL_SLICE_BYTES, SLICE_ALIGN, copy, copy_hashing, copy_pairs, leaves_of, split
from kvstore.blob import FLAT_VERSION, LEAF_BYTES, TREE_VERSION, TreeDigest, payload_checksum, payload_digest


def _pairs(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [(np.zeros(n, np.uint8), rng.integers(0, 256, n, dtype=np.uint8)) for n in sizes]


@pytest.mark.parametrize("sizes,parts", [([1], 2), ([SLICE_ALIGN * 3 + 5], 2), ([10, 70_000, 3, 9000], 3), ([100_000], 7)])
def test_split_covers_each_byte_once(sizes, parts):
    pairs = _pairs(sizes)
    groups = split(pairs, parts)
    assert len(groups) <= max(parts, 1)
    for group in groups:
        for dst, src in group:
            assert dst.size == src.size
            np.copyto(dst, src)
    for dst, src in pairs:
        assert np.array_equal(dst, src)
    assert sum(s.size for g in groups for _, s in g) == sum(sizes)


def test_big_copies_go_parallel_and_are_exact(monkeypatch):
    monkeypatch.setattr(parallel_copy, "PARALLEL_MIN_BYTES", 1)
    monkeypatch.setattr(parallel_copy, "_workers", 3)
    seen = []
    real = parallel_copy._run_tasks
    monkeypatch.setattr(parallel_copy, "_run_tasks", lambda tasks: (seen.append(len(tasks)), real(tasks)))
    pairs = _pairs([50_001, 3, 200_000], seed=1)
    copy_pairs(pairs)
    assert seen == [3]
    for dst, src in pairs:
        assert np.array_equal(dst, src)
    dst, src = _pairs([123_457], seed=2)[0]
    copy(dst, src)
    assert np.array_equal(dst, src)


def test_a_failed_slice_raises_after_every_slice_is_done(monkeypatch):
    monkeypatch.setattr(parallel_copy, "PARALLEL_MIN_BYTES", 1)
    monkeypatch.setattr(parallel_copy, "_workers", 2)
    pairs = _pairs([SLICE_ALIGN * 4])
    bad = (np.zeros(10, np.uint8), np.zeros(11, np.uint8))  # shapes differ: np.copyto raises
    with pytest.raises(ValueError):
        copy_pairs(pairs + [bad])
    assert np.array_equal(pairs[0][0], pairs[0][1])


def test_a_copy_that_starts_while_another_holds_the_pool_runs_alone(monkeypatch):
    monkeypatch.setattr(parallel_copy, "PARALLEL_MIN_BYTES", 1)
    monkeypatch.setattr(parallel_copy, "_workers", 2)
    seen = []
    monkeypatch.setattr(parallel_copy, "_run_tasks", lambda tasks: seen.append(len(tasks)))
    pairs = _pairs([SLICE_ALIGN * 4])
    with parallel_copy._busy:  # another copy has the pool
        copy_pairs(pairs)
    assert seen == [] and np.array_equal(pairs[0][0], pairs[0][1])
    copy_pairs(_pairs([SLICE_ALIGN * 4]))
    assert seen == [2]


class _ThreadsSeen(TreeDigest):
    """A tree digest that notes which threads hashed its leaves. With ``share``, the thread
    that made it waits in its first leaf until another thread has hashed one: a copy thread
    starts after the caller and takes leaves from the back, so a caller that ran ahead could
    take them all (``parallel_copy._share_out``)."""

    def __init__(self, share: bool = False):
        super().__init__()
        self.threads = set()
        self._caller = threading.get_ident()
        self._shared = threading.Event() if share else None

    def leaf_checksum(self, pieces):
        me = threading.get_ident()
        self.threads.add(me)
        if self._shared is not None:
            if me == self._caller:
                self._shared.wait(10)
            else:
                self._shared.set()
        return TreeDigest.leaf_checksum(pieces)


def _stream(sizes, seed):
    """Pairs that copy one stream of ``sum(sizes)`` bytes, cut at ``sizes``, and its source."""
    pairs = _pairs(sizes, seed)
    return pairs, b"".join(src.tobytes() for _, src in pairs)


@pytest.mark.parametrize("workers", [1, 3])
def test_copy_hashing_copies_every_byte_and_hashes_the_leaves_on_the_copy_threads(monkeypatch, workers):
    monkeypatch.setattr(parallel_copy, "PARALLEL_HASHING_MIN_BYTES", 1)
    monkeypatch.setattr(parallel_copy, "_workers", workers)
    pairs, stream = _stream([LEAF_BYTES - 128, 128 + 70_000, 3, 2 * LEAF_BYTES + 5], seed=3)
    digest = _ThreadsSeen(share=workers > 1)
    copy_hashing(pairs, digest)
    assert b"".join(dst.tobytes() for dst, _ in pairs) == stream
    assert digest.intdigest() == payload_checksum(stream, TREE_VERSION)
    assert (len(digest.threads) > 1) == (workers > 1)  # the copy threads hashed the leaves they copied
    assert not parallel_copy._busy.locked()


def test_copy_hashing_feeds_a_digest_without_leaves_in_order_on_this_thread(monkeypatch):
    monkeypatch.setattr(parallel_copy, "PARALLEL_HASHING_MIN_BYTES", 1)
    monkeypatch.setattr(parallel_copy, "_workers", 3)
    pairs, stream = _stream([SEAL_SLICE_BYTES + 7, 10, 3 * SEAL_SLICE_BYTES], seed=4)
    digest = payload_digest(FLAT_VERSION)
    copy_hashing(pairs, digest)
    assert b"".join(dst.tobytes() for dst, _ in pairs) == stream
    assert digest.intdigest() == payload_checksum(stream, FLAT_VERSION)


def test_copy_hashing_waits_for_every_leaf_before_it_raises_a_failed_one(monkeypatch):
    monkeypatch.setattr(parallel_copy, "PARALLEL_HASHING_MIN_BYTES", 1)
    monkeypatch.setattr(parallel_copy, "_workers", 2)
    pairs, _ = _stream([4 * LEAF_BYTES], seed=5)
    bad = (np.zeros(10, np.uint8), np.zeros(11, np.uint8))  # shapes differ: np.copyto raises
    with pytest.raises(ValueError):
        copy_hashing([bad] + pairs, TreeDigest())  # the failure is in this thread's share
    assert np.array_equal(pairs[0][0][2 * LEAF_BYTES :], pairs[0][1][2 * LEAF_BYTES :])  # the other thread's share
    assert not parallel_copy._busy.locked()


def test_the_copy_threads_take_items_from_the_back_and_leave_the_last_one_to_the_caller(monkeypatch):
    """So the caller, which starts first, also ends last, and never sleeps until a copy thread
    wakes it. Its first item waits until the copy thread has taken all it will take."""
    if parallel_copy.workers() == 1:
        pytest.skip("one core: copies run in the caller's thread, there is no pool")
    monkeypatch.setattr(parallel_copy, "_workers", 2)
    n, caller = 10, threading.current_thread()
    done = {"caller": [], "thread": []}
    taken = threading.Condition()

    def do(i: int) -> None:
        if threading.current_thread() is caller:
            if i == 0:
                with taken:
                    taken.wait_for(lambda: len(done["thread"]) >= n - 2, timeout=10)
            done["caller"].append(i)
        else:
            with taken:
                done["thread"].append(i)
                taken.notify_all()

    with parallel_copy._busy:
        parallel_copy._share_out(n, do)
    assert done == {"caller": [0, 1], "thread": list(range(n - 1, 1, -1))}


def test_leaves_of_cuts_a_stream_at_each_multiple_of_the_leaf_and_nowhere_else():
    pairs, stream = _stream([5, 17, 1, 40], seed=6)
    leaves = leaves_of(pairs, 8)
    assert [sum(src.size for _, src in leaf) for leaf in leaves] == [8] * 7 + [7]
    assert b"".join(src.tobytes() for leaf in leaves for _, src in leaf) == stream
    assert leaves_of([], 8) == []


def test_a_copy_whose_wait_is_interrupted_gives_up_the_pool(monkeypatch):
    """A signal's exception (Ctrl-C) in the wait for a worker: the worker still ends its
    task later, and a later copy must not take that end for the end of its own slices."""
    monkeypatch.setattr(parallel_copy, "PARALLEL_MIN_BYTES", 1)
    if parallel_copy.workers() == 1:
        pytest.skip("one core: copies run in the caller's thread, there is no pool")
    pool = parallel_copy._threads()
    join = parallel_copy._Worker.join

    def interrupted(self):
        monkeypatch.setattr(parallel_copy._Worker, "join", join)
        join(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(parallel_copy._Worker, "join", interrupted)
    with pytest.raises(KeyboardInterrupt):
        copy_pairs(_pairs([SLICE_ALIGN * 8]))
    assert parallel_copy._pool is None and not parallel_copy._busy.locked()
    pairs = _pairs([SLICE_ALIGN * 8 + 3], seed=7)
    copy_pairs(pairs)
    assert parallel_copy._pool is not None and parallel_copy._pool is not pool
    assert np.array_equal(pairs[0][0], pairs[0][1])


def test_a_forked_child_copies_on_a_pool_of_its_own():
    """A child forked after the parent's pool started has none of its threads: before, its
    first big copy waited forever for workers that did not exist (a process forked from one
    that used a Store or a Client, as engines fork their workers)."""
    if parallel_copy.workers() == 1:
        pytest.skip("one core: copies run in the caller's thread, there is no pool")
    parallel_copy.start()
    _copy_in_a_forked_child(team=False)


def _copy_in_a_forked_child(team: bool) -> None:
    """A big copy in a child forked now must end, and copy every byte."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=_copy_big_and_check, args=(team,))
    child.start()
    child.join(30)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("the forked child's copy never ended")
    assert child.exitcode == 0


def _copy_big_and_check(team: bool) -> None:
    pairs = _pairs([parallel_copy.PARALLEL_MIN_BYTES + 5], seed=8)
    copy_pairs(pairs, team=team)
    os._exit(0 if np.array_equal(pairs[0][0], pairs[0][1]) else 1)


@pytest.fixture
def torch_on_two_threads(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(parallel_copy, "_team_off_until", 0.0)  # no slow copy of an earlier test's counts
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield torch
    torch.set_num_threads(threads)


def _pool_tasks(monkeypatch) -> list[int]:
    """How many tasks each copy handed the copy threads (none: it did not use them)."""
    seen = []
    real = parallel_copy._run_tasks
    monkeypatch.setattr(parallel_copy, "_run_tasks", lambda tasks: (seen.append(len(tasks)), real(tasks)))
    monkeypatch.setattr(parallel_copy, "PARALLEL_MIN_BYTES", 1)
    monkeypatch.setattr(parallel_copy, "_workers", 2)
    return seen


def test_a_copy_that_asks_for_a_team_runs_on_torchs_team_on_the_main_thread_only(monkeypatch, torch_on_two_threads):
    seen = _pool_tasks(monkeypatch)
    sizes = [parallel_copy.TEAM_MIN_BYTES + 3, 5, 2 * parallel_copy.TEAM_MIN_BYTES]
    pairs = _pairs(sizes, seed=9)
    copy_pairs(pairs, team=True)
    assert seen == [] and all(np.array_equal(d, s) for d, s in pairs)

    copy_pairs(_pairs(sizes, seed=10))  # one that does not ask
    assert seen == [2]

    elsewhere = _pairs(sizes, seed=11)
    thread = threading.Thread(target=copy_pairs, args=(elsewhere,), kwargs={"team": True})
    thread.start()
    thread.join()
    assert seen == [2, 2] and all(np.array_equal(d, s) for d, s in elsewhere)

    torch_on_two_threads.set_num_threads(1)  # no team to speak of
    copy_pairs(_pairs(sizes, seed=12), team=True)
    assert seen == [2, 2, 2]


def test_a_slow_copy_on_the_team_sends_the_next_ones_to_the_copy_threads_for_a_while(monkeypatch,
                                                                                   torch_on_two_threads):
    """A team's copy waits for its slowest thread: with more runnable threads than cores, one
    the scheduler took off its core cost a 5.6 MiB copy 12 ms, where the copy threads took 0.3."""
    seen = _pool_tasks(monkeypatch)
    monkeypatch.setattr(parallel_copy, "TEAM_BACKOFF_S", 1.0)  # far longer than two copies take
    monkeypatch.setattr(parallel_copy, "TEAM_SLOW_BYTES_PER_S", 1e30)  # every copy is too slow
    monkeypatch.setattr(parallel_copy, "TEAM_SLICE_S", 0.0)
    sizes = [2 * parallel_copy.TEAM_MIN_BYTES]
    slow_copy_started = time.monotonic()
    copy_pairs(_pairs(sizes, seed=14), team=True)
    assert seen == []  # on the team
    pairs = _pairs(sizes, seed=15)
    copy_pairs(pairs, team=True)
    assert seen == [2] and all(np.array_equal(d, s) for d, s in pairs)

    monkeypatch.setattr(parallel_copy, "TEAM_SLOW_BYTES_PER_S", 1.0)  # none is too slow now
    deadline = time.monotonic() + 30
    while True:
        copies = len(seen)
        copy_pairs(_pairs(sizes, seed=16), team=True)
        if len(seen) == copies or time.monotonic() > deadline:
            break
    assert len(seen) == copies, "the copies never went back to the team"
    assert time.monotonic() - slow_copy_started >= 1.0


def test_a_teams_copy_into_read_only_memory_raises_as_on_the_copy_threads(monkeypatch, torch_on_two_threads):
    """torch would write through a view of a read-only buffer (a crash, or a write into a
    page the caller never lent); np.copyto refuses it, as the copy threads do."""
    _pool_tasks(monkeypatch)
    src = np.arange(2 * parallel_copy.TEAM_MIN_BYTES, dtype=np.uint64).view(np.uint8)
    dst = np.frombuffer(bytes(src.size), np.uint8)
    with pytest.raises(ValueError):
        copy_pairs([(dst, src)], team=True)
    assert not dst.any()
    readonly_src = np.frombuffer(src.tobytes(), np.uint8)
    out = np.zeros(src.size, np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on a view of a read-only array
        copy_pairs([(out, readonly_src)], team=True)
    assert np.array_equal(out, src)


def test_a_forked_child_copies_off_the_team_its_parent_ran(torch_on_two_threads):
    """GNU OpenMP's team never starts in a child forked after the parent's ran: a Store's
    read from host RAM in an engine's forked worker waited forever on a torch copy."""
    copy_pairs(_pairs([parallel_copy.PARALLEL_MIN_BYTES + 5], seed=13), team=True)  # the parent's team runs
    _copy_in_a_forked_child(team=True)
