"""Many threads on one Store, on overlapping keys, with faults: whatever interleaving the
scheduler picks, a read returns one of the encodings put for that key (each key always
names one tensor, as a prefix hash does) or a miss, never bytes of another key or torn
ones; and once the threads stop, index, tiers, policies and queues agree.

The fault campaign (test_store_faults.py) checks the exact promises with one caller; this
one checks that concurrent callers cannot break the books or mix bytes.
"""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch

from faults import FaultyTier
from helpers import PAGE, same, store_config
from kvstore.store import Store
from store_model import CODECS, MODEL_NS, NS_PLACED, place, reachable
from tiers.base import TierError
from tiers.disk import DiskTier


def _run(tmp_path, threads: int, ops: int, seconds: float | None = None, placement: bool = False) -> int:
    """With ``placement``: chunks of 5 pages that placement re-encodes in host RAM and on a
    disk with room for half of them, replicas planned by utility (tests/store/store_model.py)."""
    from helpers import chunks

    keys, values = chunks(12, NS_PLACED if placement else MODEL_NS, seed=3)
    expected = [[e for c in CODECS for e in reachable(v, c, placement)] for v in values]
    pages = 5 if placement else 1
    cfg = store_config(tmp_path, host=10 * pages * PAGE, disk=None, pending=4 * pages * PAGE, max_pin_ttl_s=0.2)
    cfg.write_behind.stall_s = 0.2
    cfg.write_behind.durable_timeout_s = 0.5
    cfg.fetch_stall_s = 0.01  # takeovers happen
    if placement:
        place(cfg, tmp_path)
    disk = FaultyTier(DiskTier(tmp_path / "disk", 6 * pages * PAGE if placement else 1 << 20, name="disk"))
    store = Store(cfg, extra_tiers=[disk], extra_fetch_workers={"disk": 3})
    errors: list[str] = []
    done = [0]
    deadline = None if seconds is None else time.monotonic() + seconds

    def check(i, got):
        if not any(same(got, e) for e in expected[i]):
            errors.append(f"key {i}: bytes that no put of it wrote")

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        outs = [torch.empty_like(values[0]) for _ in keys]
        n = 0
        while (n < ops) if deadline is None else (time.monotonic() < deadline):
            n += 1
            r, i = rng.random(), rng.randrange(len(keys))
            try:
                if r < 0.35:
                    store.put(keys[i], values[i], codec=rng.choice(CODECS), durable=rng.random() < 0.1)
                elif r < 0.55:
                    out = torch.empty_like(values[i])
                    if store.get_into(keys[i], out):
                        check(i, out)
                elif r < 0.70:
                    start = rng.randrange(len(keys))
                    got = store.get_many_into(keys[start:], outs[: len(keys) - start])
                    for j in range(got):
                        check(start + j, outs[j])
                elif r < 0.78:
                    start = rng.randrange(len(keys))
                    for j, chunk in enumerate(store.stream(keys[start:])):
                        check(start + j, chunk)
                        if rng.random() < 0.3:
                            break
                elif r < 0.84:
                    store.delete([keys[i]])
                elif r < 0.88:
                    store.drop([keys[i]], "host")
                elif r < 0.94:
                    store.pin([keys[i]], rng.choice((0.01, 0.1)))
                elif r < 0.97:
                    store.unpin([keys[i]])
                elif r < 0.985:
                    disk.failures["write"] = disk.failures.get("write", 0) + 1
                else:
                    disk.flip_reads = 1
            except (TierError, TimeoutError):
                pass  # injected faults and full tiers are allowed to fail a call, never to corrupt
        done[0] += n

    pool = [threading.Thread(target=worker, args=(s,)) for s in range(threads)]
    try:
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        assert not errors, errors[:5]
        disk.failures.clear()
        disk.flip_reads = 0
        assert store.flush(timeout_s=60)
        store.check_integrity()
    finally:
        store.close()
    return done[0]


@pytest.mark.parametrize("placement", [False, True], ids=["plain", "placement"])
def test_concurrent_callers_never_mix_bytes_or_break_the_books(tmp_path, placement):
    assert _run(tmp_path, threads=4, ops=250, placement=placement) == 1000


@pytest.mark.long
@pytest.mark.timeout(0)  # runs for KVSTORE_CONCURRENCY_S
@pytest.mark.parametrize("placement", [False, True], ids=["plain", "placement"])
def test_concurrent_callers_for_a_long_while(tmp_path, placement):
    seconds = float(os.environ.get("KVSTORE_CONCURRENCY_S", "600"))
    ops = _run(tmp_path, threads=6, ops=0, seconds=seconds, placement=placement)
    print(f"concurrency soak{' with placement' if placement else ''}: {ops} operations from 6 threads in "
          f"{seconds:.0f} s, no wrong bytes, books agree")
