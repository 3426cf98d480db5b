"""Store.prefetch: a prefetch whose future is cancelled before it runs stops counting as in
flight. Before the fix its task never ran, so the ``finally`` inside it never took the key
out of ``Store._prefetching``: the key was never prefetched again, and its place counted
against ``prefetch_max_inflight`` for good.

A cancelled future is what the daemon's Prefetch(wait=True) produces when its RPC is
cancelled: `asyncio.wrap_future` passes the cancellation on to the Store's future.
"""

from __future__ import annotations

from faults import FaultyTier, Gate, wait_until
from helpers import chunks, store_config
from kvstore.store import Store
from tiers.disk import DiskTier


def test_a_cancelled_prefetch_does_not_block_that_key_or_the_bound_forever(tmp_path):
    cfg = store_config(tmp_path, disk=None, prefetch_max_inflight=64)
    disk = FaultyTier(DiskTier(tmp_path / "disk", 1 << 20, name="disk"))
    store = Store(cfg, extra_tiers=[disk])
    with store:
        readers = store._readers._max_workers
        keys, values = chunks(readers + 1)
        for k, v in zip(keys, values):
            store.put(k, v, durable=True)
        store.drop(keys, "host")
        gate = disk.gates["read"] = Gate()
        futures = store.prefetch(keys)
        assert len(futures) == readers + 1
        wait_until(lambda: gate.waiting == readers, what="every reader thread held")
        assert futures[-1].cancel()  # still queued: the caller (or the daemon's RPC) gives up on it
        gate.open()
        assert all(f.result(timeout=10) is not None for f in futures[:-1])
        # nothing reads keys[-1] any more; a new prefetch of it must start one
        again = store.prefetch(keys[-1:])
        assert len(again) == 1, f"the cancelled key is still counted in flight: {store._prefetching}"
        assert again[0].result(timeout=10) is not None
