"""A chunk served once is counted as one hit.

``kvbench replay`` reports hit % of block accesses per serving tier, and models each
request's load time from the bytes each tier read, both from the Store's per-tier stats
(``hits``, ``bytes_read``); ``kvbench fetch`` reports each tier's share of chunks from
``hits`` too. When a stalled read is taken over by another tier (free-tier fetching), both
reads finished and both counted a hit and their bytes, so one chunk served was two hits (and
twice its bytes, and two accesses for the tier's eviction policy). Observed in a replay of
``workload:saas`` (400 requests, ``default+compress``): ``total_hit_pct`` 12.05 against
11.99% of accesses actually loaded (the sum of ``get_many_into``'s returns).

Deterministic: both tiers' reads of the chunk are held at gates (whichever claims it first
stalls, the other takes it over after ``fetch_stall_s``); b's is let through and serves the
chunk, then a's completes too.
"""

import torch

from faults import Call, FaultyTier, Gate, wait_until
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig, WriteBehindConfig
from kvstore.keys import Namespace, chunk_keys
from kvstore.store import Store
from tiers.disk import DiskTier

ONE_HEAD_NS = Namespace("review-bench-takeover", 1, 1, 16, "float16", 16)
PAGE = 4096


def test_a_chunk_taken_over_from_a_stalled_tier_counts_one_hit(tmp_path):
    cfg = StoreConfig(host=HostTierConfig(capacity_bytes=64 * PAGE, page_bytes=PAGE, prefault=False),
                      disk=DiskTierConfig(enabled=False), write_behind=WriteBehindConfig(max_pending_bytes=16 * PAGE),
                      promote_on_read=False, fetch_stall_s=0.01)
    a = FaultyTier(DiskTier(tmp_path / "a", 1 << 24, name="a"))
    b = FaultyTier(DiskTier(tmp_path / "b", 1 << 24, name="b"))
    with Store(cfg, extra_tiers=[a, b], extra_fetch_workers={"a": 1, "b": 1}) as store:
        keys = chunk_keys(list(range(ONE_HEAD_NS.chunk_tokens)), ONE_HEAD_NS)
        value = torch.randn(ONE_HEAD_NS.chunk_shape).half()
        store.put(keys[0], value, durable=True)
        store.drop(keys, "host")
        assert store.replicas(keys) == [frozenset({"a", "b"})]
        before = {n: (s.hits, s.bytes_read) for n, s in store.stats().tiers.items()}
        gates = {t.name: Gate(key=keys[0].id) for t in (a, b)}
        a.gates["read"], b.gates["read"] = gates["a"], gates["b"]
        out = torch.zeros_like(value)
        call = Call(lambda: store.get_many_into(keys, [out]))
        # whichever tier claims the chunk first stalls at its gate; the other takes it over
        wait_until(lambda: all(g.entered.is_set() for g in gates.values()), what="a read and its takeover")
        # open b's read; once it has served the chunk, open a's: both reads complete
        gates["b"].open()
        wait_until(lambda: store.stats().tiers["b"].hits > before["b"][0], what="b's read to serve the chunk")
        gates["a"].open()
        assert call.outcome() == 1 and torch.equal(out, value)
        # a takeover reads into a buffer of its own, which the get does not wait for: wait for
        # every fetch worker to be done (one worker a tier, so a no-op queued behind it will do)
        for pool in store._fetch_pools.values():
            pool.submit(lambda: None).result(timeout=10)
        after = {n: (s.hits, s.bytes_read) for n, s in store.stats().tiers.items()}
        hits = {n: after[n][0] - before[n][0] for n in after}
        read = {n: after[n][1] - before[n][1] for n in after}
        assert sum(hits.values()) == 1, f"one chunk served, counted as {hits}"
        assert sum(read.values()) == max(read.values()), f"bytes of one chunk counted as {read}"
