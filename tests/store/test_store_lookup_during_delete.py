"""A lookup that ran while a delete removed a chunk's files brought the deleted chunk back.

``Store.delete`` takes the entry out of the index under its lock, then removes each tier's
value under that (tier, key) lock, skipping a value the index lists again by then (a newer
copy's). ``lookup`` of a key the index lacks asks the shared tiers (``discover``: a stat
of the PFS file, or the shared index) and recorded what it found as a new entry, without
looking at deletes in flight. So a lookup between the delete's pop and its removal of the
PFS file finds the file, lists it, and the delete then spares it as "a newer copy": delete
returns with the file on the mount and the chunk in the index, and reads serve the deleted
bytes (and a restart finds them again). docs/store.md: "a deleted chunk never comes back".

Found by tests/store/test_store_walk_tiers.py (a reader thread's ``stream``/``replicas`` beside
the walk's deletes).
"""

from __future__ import annotations

import torch

from faults import Call, FaultyTier, Gate
from helpers import PAGE, chunks, same, store_config
from kvstore.store import Store
from tiers.pfs import PfsTier


def _store(tmp_path) -> tuple[Store, FaultyTier]:
    pfs = FaultyTier(PfsTier(tmp_path / "pfs", 1 << 20, name="pfs"))
    return Store(store_config(tmp_path, host=16 * PAGE, disk=None, pending=4 * PAGE), extra_tiers=[pfs]), pfs


def _gate_deletes(store: Store, tier_name: str) -> Gate:
    """Hold the delete's removal of one tier's value, before it takes the key lock (where it
    would be after removing the other tiers' values)."""
    gate = Gate()
    delete = store._io.delete

    def gated(tier, key_id):
        if tier.name == tier_name:
            gate.pass_through(key_id)
        return delete(tier, key_id)

    store._io.delete = gated
    return gate


def test_a_lookup_during_a_delete_does_not_bring_the_chunk_back(tmp_path):
    keys, values = chunks(1, seed=11)
    key = keys[0]
    store, pfs = _store(tmp_path)
    try:
        store.put(key, values[0])
        assert store.flush(timeout_s=10)
        assert store.replicas(keys) == [frozenset({"host", "pfs"})]
        gate = _gate_deletes(store, "pfs")
        deleting = Call(lambda: store.delete(keys))
        assert gate.entered.wait(10)  # out of the index; the PFS file not removed yet
        store.lookup(keys)  # concurrent with the delete: either answer is fine
        gate.open()
        assert deleting.outcome() == 1
        # the delete has returned: the chunk is gone, everywhere
        assert store.lookup(keys) == 0, "lookup finds a chunk whose delete returned"
        out = torch.empty_like(values[0])
        hit = store.get_into(key, out)
        assert not (hit and same(out, values[0])), "a read after the delete returned the deleted bytes"
        assert not list((tmp_path / "pfs").glob("**/*.kvb")), "the deleted chunk's PFS file is still there"
    finally:
        store.close()
    store, pfs = _store(tmp_path)
    try:
        assert store.lookup(keys) == 0, "the deleted chunk came back after a restart"
    finally:
        store.close()



def test_a_lookup_that_saw_the_file_before_the_delete_removed_it_does_not_list_it(tmp_path):
    """The other order: the lookup's stat of the PFS file comes while the delete runs, before
    it removes the file, and the lookup records what it saw after the delete returned.
    Before the fix the index then listed a file that is gone: lookups and pins counted the
    deleted chunk present (until a read missed on it)."""
    keys, values = chunks(1, seed=12)
    key = keys[0]
    store, pfs = _store(tmp_path)
    try:
        store.put(key, values[0])
        assert store.flush(timeout_s=10)
        removal = _gate_deletes(store, "pfs")
        seen = Gate(key.id)
        size_of = pfs.size_of

        def stat_then_wait(key_id):
            size = size_of(key_id)
            seen.pass_through(key_id)  # the file was there when the lookup looked
            return size

        pfs.size_of = stat_then_wait
        deleting = Call(lambda: store.delete(keys))
        assert removal.entered.wait(10)  # out of the index; the PFS file not removed yet
        looking = Call(lambda: store.lookup(keys))
        assert seen.entered.wait(10)
        removal.open()
        assert deleting.outcome() == 1  # the file is gone now
        assert not list((tmp_path / "pfs").glob("**/*.kvb"))
        seen.open()
        looking.outcome()
        pfs.size_of = size_of
        assert store.lookup(keys) == 0, "the index lists the deleted chunk's PFS file, which is gone"
        assert store.pin(keys, 10.0) == 0, "a pin counts the deleted chunk present"
    finally:
        store.close()
