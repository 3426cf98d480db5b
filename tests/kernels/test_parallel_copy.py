"""kernels/parallel_copy.py: slices cover every byte exactly once, and big copies are exact."""

import numpy as np
import pytest

from kernels import parallel_copy
from kernels.parallel_copy import SLICE_ALIGN, copy, copy_pairs, split


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
    real = parallel_copy._run
    monkeypatch.setattr(parallel_copy, "_run", lambda groups: (seen.append(len(groups)), real(groups)))
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
    monkeypatch.setattr(parallel_copy, "_run", lambda groups: seen.append(len(groups)))
    pairs = _pairs([SLICE_ALIGN * 4])
    with parallel_copy._busy:  # another copy has the pool
        copy_pairs(pairs)
    assert seen == [] and np.array_equal(pairs[0][0], pairs[0][1])
    copy_pairs(_pairs([SLICE_ALIGN * 4]))
    assert seen == [2]


def test_copy_behind_copies_on_the_pool_while_the_caller_works_and_waits_for_every_slice(monkeypatch):
    monkeypatch.setattr(parallel_copy, "_workers", 3)
    pairs = _pairs([SLICE_ALIGN * 4 + 1, 70_000, 5], seed=3)
    wait = parallel_copy.copy_behind(pairs)
    assert parallel_copy._busy.locked()  # the pool is this copy's until it is waited for
    wait()
    assert not parallel_copy._busy.locked()
    assert all(np.array_equal(d, s) for d, s in pairs)
    with parallel_copy._busy:  # another copy has the pool: copied here, at once
        pairs = _pairs([SLICE_ALIGN * 2], seed=4)
        wait = parallel_copy.copy_behind(pairs)
        assert np.array_equal(pairs[0][0], pairs[0][1])
        wait()
    bad = (np.zeros(10, np.uint8), np.zeros(11, np.uint8))  # shapes differ: np.copyto raises
    wait = parallel_copy.copy_behind(_pairs([SLICE_ALIGN]) + [bad])
    with pytest.raises(ValueError):
        wait()
    assert not parallel_copy._busy.locked()
