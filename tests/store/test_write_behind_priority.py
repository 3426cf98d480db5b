"""The write-behind's copy threads run at a lower priority than the callers' puts and reads.

On a machine with few cores a buffered copy to the disk tier takes a core while it lasts;
measured on this 2-core VM, puts of 32 MiB chunks beside the write-behind ran at about
5 GB/s with the copy threads at the callers' priority and about 10 GB/s at niceness 19
(docs/benchmarks.md). A thread inherits the priority of the thread that starts it, so the
pool of kernels/parallel_copy.py, which callers' copies use, is started by the Store first.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from helpers import chunks, store_config
from kernels import parallel_copy
from kvstore.config import ConfigError, WriteBehindConfig
from kvstore.store import Store

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")


def _nice(thread: threading.Thread) -> int:
    return os.getpriority(os.PRIO_PROCESS, thread.native_id)


def _copiers(store: Store) -> list[threading.Thread]:
    """This store's copy threads (other tests' stores may still have theirs)."""
    return list(store._write_behind._threads)


def _wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("nice", [7, 0])
def test_copy_threads_run_at_the_configured_niceness(tmp_path, nice):
    """0 leaves them at the caller's priority."""
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    config = store_config(tmp_path)
    config.write_behind = WriteBehindConfig(max_pending_bytes=config.write_behind.max_pending_bytes, nice=nice)
    store = Store(config)
    try:
        keys, kvs = chunks(2)
        for k, kv in zip(keys, kvs):
            store.put(k, kv)
        assert store.flush(30)
        copiers = _copiers(store)
        assert len(copiers) == config.write_behind.workers
        assert _wait_for(lambda: all(_nice(t) == min(19, base + nice) for t in copiers)), [_nice(t) for t in copiers]
    finally:
        store.close()


def test_the_callers_copy_pool_is_started_before_the_copy_threads(tmp_path, monkeypatch):
    """Its workers exist once the Store is made, started by the thread that made it: none is
    started later by a copy thread at niceness 19."""
    if parallel_copy.workers() == 1:
        pytest.skip("one core: copies run in the caller's thread, there is no pool")
    monkeypatch.setattr(parallel_copy, "_pool", None)  # as in a fresh process
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    store = Store(store_config(tmp_path))
    try:
        pool = parallel_copy._pool
        assert pool is not None
        workers = [w.thread for w in pool]
        assert len(workers) == parallel_copy.workers() - 1
        assert all(_nice(t) == base for t in workers)
    finally:
        store.close()


@pytest.mark.parametrize("nice", [-1, 20])
def test_a_niceness_outside_0_to_19_is_refused(tmp_path, nice):
    config = store_config(tmp_path)
    config.write_behind = WriteBehindConfig(nice=nice)
    with pytest.raises(ConfigError, match="write_behind.nice"):
        config.validate()
