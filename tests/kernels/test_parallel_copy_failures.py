"""``copy_pairs`` must not return while a worker still writes the destination.

kernels/parallel_copy.py promises "A copy returns only when every slice is written: nothing
touches either buffer afterwards", also when a slice fails: a copy that stopped waiting at
the first failed slice would return (raise) while the third slice is still copying (with
three or more slices: any machine with 4+ cores).

For HostTier.read_into that means: the pin on the value's pages is released when the call
raises, a delete and another put reuse those pages, and the late slice copies the other
value's bytes into the caller's buffer after the call has returned.

The failing slice here is a real one (a read-only destination range: np.copyto refuses it);
the only injected hook holds the third slice's np.copyto at a gate, so that the order of
events does not depend on thread scheduling.
"""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest

from kernels import parallel_copy
from tiers.host import HostTier

GATE_S = 2.0  # the held slice waits at most this long (a fixed copy waits for it)


@pytest.fixture
def three_slices(monkeypatch):
    """Copies split in 3 slices over a pool of its own (2 worker threads), on any machine,
    also those that ask for torch's team."""
    monkeypatch.setattr(parallel_copy, "_torch_team", lambda: None)
    monkeypatch.setattr(parallel_copy, "_workers", 3)
    monkeypatch.setattr(parallel_copy, "_pool", None)  # its threads wait for work as daemon threads


def _hold_copies_into(monkeypatch, target: np.ndarray):
    """np.copyto, in parallel_copy only, held at a gate (for at most GATE_S) when it writes
    into ``target``; returns (gate, finished event, record of writes after ``returned``)."""
    gate, finished = threading.Event(), threading.Event()
    state = {"returned": False, "late_writes": 0}
    real = np.copyto

    def copyto(dst, src, *args, **kwargs):
        if np.shares_memory(dst, target):
            gate.wait(GATE_S)
            real(dst, src, *args, **kwargs)
            if state["returned"]:
                state["late_writes"] += 1
            finished.set()
            return
        real(dst, src, *args, **kwargs)

    shim = types.SimpleNamespace(**{name: getattr(np, name) for name in dir(np) if not name.startswith("__")})
    shim.copyto = copyto
    monkeypatch.setattr(parallel_copy, "np", shim)
    return gate, finished, state


def test_copy_pairs_does_not_return_while_a_later_slice_still_writes(three_slices, monkeypatch):
    share = 64 << 10
    monkeypatch.setattr(parallel_copy, "PARALLEL_MIN_BYTES", 1)
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 3 * share, dtype=np.uint8)
    first, third = np.zeros(share, np.uint8), np.zeros(share, np.uint8)
    readonly = np.zeros(share, np.uint8)
    readonly.flags.writeable = False  # the second slice fails: np.copyto refuses it
    pairs = [(first, src[:share]), (readonly, src[share : 2 * share]), (third, src[2 * share :])]
    assert [len(g) for g in parallel_copy.split(pairs, 3)] == [1, 1, 1]
    gate, finished, state = _hold_copies_into(monkeypatch, third)

    with pytest.raises(ValueError):
        parallel_copy.copy_pairs(pairs)
    state["returned"] = True
    snapshot = third.copy()
    gate.set()
    assert finished.wait(10)
    assert state["late_writes"] == 0 and np.array_equal(third, snapshot), (
        "copy_pairs raised while a worker still had a slice to write: it wrote the "
        "destination after the call returned")


def test_host_read_into_never_copies_pages_reused_after_it_raised(three_slices, monkeypatch):
    tier = HostTier(16 << 20, page_bytes=256 << 10, prefault=False)
    try:
        share = 2 << 20  # 3 x 2 MiB: above PARALLEL_MIN_BYTES, one slice per buffer
        mine = np.full(3 * share, 0x11, np.uint8)
        other = np.full(3 * share, 0xEE, np.uint8)
        tier.write(b"mine", [mine])
        a, c = bytearray(share), bytearray(share)
        b = bytes(share)  # read-only: the slice into it fails
        gate, finished, state = _hold_copies_into(monkeypatch, np.frombuffer(c, np.uint8))

        with pytest.raises(ValueError):
            tier.read_into(b"mine", [a, b, c])
        state["returned"] = True
        snapshot = bytes(c)
        # the read has returned: its pin is gone, so its pages may go to another value
        assert tier.delete(b"mine")
        tier.write(b"other", [other])
        gate.set()
        assert finished.wait(10)
        assert bytes(c) == snapshot, (
            f"read_into raised, then wrote {c[:1].hex()}.. (the next value's bytes, from pages "
            "reused after its pin was released) into the caller's buffer")
    finally:
        tier.close()
