"""Every chunk a lookup discovered on a shared tier got version 0, so a chunk deleted and
discovered again had the version it had: a promotion of a read of the first one, checked
by version (``Store._promote``: "unless it changed meanwhile (replaced, deleted: a
deleted chunk never comes back)"), took the second for the same chunk and wrote the
first one's bytes into host RAM as its current copy. Reads then returned the older put's
bytes (another codec), never the blob the shared tier holds now.

The sequence: daemon B puts a chunk on the shared PFS; A finds it by a lookup (version 0)
and reads it; before A's read promotes it, A deletes the chunk, B puts it again in another
codec, and A's lookup finds that one (version 0 again). The promotion then goes ahead.
"""

from __future__ import annotations

import torch

from faults import Call, Gate
from helpers import PAGE, chunks, same, store_config
from kvstore.codecs import get_codec
from kvstore.store import Store
from tiers.pfs import PfsTier


def _daemon(tmp_path, name: str) -> Store:
    cfg = store_config(tmp_path / name, host=16 * PAGE, disk=None, pending=4 * PAGE)
    return Store(cfg, extra_tiers=[PfsTier(tmp_path / "pfs", 1 << 20, name="pfs")])


def test_a_promotion_of_a_deleted_chunk_is_not_taken_for_the_chunk_discovered_since(tmp_path):
    keys, values = chunks(1, seed=21)
    key, value = keys[0], values[0]
    int8 = get_codec("int8")
    as_int8 = int8.decode(int8.encode(value), value.shape, value.dtype)
    assert not same(as_int8, value)
    a, b = _daemon(tmp_path, "a"), _daemon(tmp_path, "b")
    try:
        b.put(key, value, durable=True)  # raw, on the PFS
        assert a.lookup(keys) == 1  # discovered: A's entry, version 0
        gate = Gate(key.id)
        promote = a._reads._promote

        def held(key_id, *args):
            gate.pass_through(key_id)  # the read is verified and counted; its promotion waits
            return promote(key_id, *args)

        a._reads._promote = held
        out = torch.empty_like(value)
        reading = Call(lambda: a.get_into(key, out))
        assert gate.entered.wait(10)
        assert a.delete(keys) == 1  # the PFS file is gone
        b.put(key, value, durable=True, codec="int8")  # B puts the chunk again, as int8
        assert a.lookup(keys) == 1  # discovered again: version 0 again
        gate.open()
        assert reading.outcome()  # concurrent with all that: either blob is fine
        again = torch.empty_like(value)
        assert a.get_into(key, again)
        assert same(again, as_int8), (
            "A's read returned the deleted raw blob's bytes, promoted into host RAM as the copy of "
            "the int8 blob the PFS holds now")
    finally:
        a.close()
        b.close()
