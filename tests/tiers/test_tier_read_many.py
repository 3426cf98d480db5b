"""``read_many_into`` (tiers/disk.py, inherited by the PFS tier) returns, or raises, only once
no read writes the caller's buffers. Before the fix, when one read raised, ``list(pool.map(...))``
raised at once while the other reads were still running, and a caller that reused a buffer
had it overwritten by a late read."""

from __future__ import annotations

import threading

from faults import Gate
from tiers.disk import DiskTier
from tiers.pfs import PfsTier

import pytest


def _gated(cls):
    class Gated(cls):
        gates: dict = {}
        done = threading.Event()

        def read_into(self, key, out):
            gate = self.gates.get(key)
            if gate is not None:
                gate.pass_through(key)
            try:
                return super().read_into(key, out)
            finally:
                if gate is not None and key == b"k1".ljust(16, b"\0"):
                    self.done.set()
    return Gated


@pytest.mark.parametrize("cls", [DiskTier, PfsTier])
def test_read_many_into_returns_only_when_no_read_writes_the_buffers(tmp_path, cls):
    tier = _gated(cls)(tmp_path, 1 << 22, read_threads=2)
    k0, k1 = b"k0".ljust(16, b"\0"), b"k1".ljust(16, b"\0")
    tier.write(k0, [b"a" * 8192])
    tier.write(k1, [b"b" * 4096])
    first, second = Gate(k0), Gate(k1)
    tier.gates = {k0: first, k1: second}
    outs = [bytearray(4096), bytearray(4096)]  # outs[0] is too small for k0: its read raises
    errors = []

    def call():
        try:
            tier.read_many_into([k0, k1], outs)
        except ValueError as exc:
            errors.append(exc)

    t = threading.Thread(target=call)
    t.start()
    assert first.entered.wait(10) and second.entered.wait(10)  # both reads under way
    first.open()
    t.join(0.5)
    returned = not t.is_alive()
    outs[1][:] = b"\x07" * 4096  # the caller reuses its buffer once the call returned
    second.open()
    assert tier.done.wait(10)
    t.join(10)
    tier.close()
    assert errors
    assert not (returned and bytes(outs[1]) != b"\x07" * 4096), "a read wrote into a buffer after the call returned"
