"""A copy waits ``write_behind.delay_s`` after its put, so that a burst of puts runs without
copies beside it (a copy written during the burst halved its speed and tripled its P99,
issue #37); whoever waits for copies takes them at once: a durable put, a flush, a drop, a
put that needs the host RAM that waiting copies hold. The delay here is a minute, so that a
test that waited on it would run out of its timeouts."""

from __future__ import annotations

import torch

from faults import Call, wait_until
from helpers import chunks, same, store_with_faulty_disk
from kvstore.blob import HEADER_BYTES
from kvstore.keys import Namespace
from kvstore.store import Store

PAGE_SIZED_NS = Namespace("test-model", num_layers=2, num_kv_heads=2, head_dim=30, chunk_tokens=8)
DELAY_S = 60.0


def delayed_store(tmp_path, host_pages: int = 64):
    return store_with_faulty_disk(tmp_path, host_pages, workers=1, delay_s=DELAY_S)


def loads(store: Store, key, value) -> bool:
    out = torch.empty_like(value)
    return store.get_into(key, out) and same(out, value)


def test_a_burst_of_puts_waits_for_no_copy_and_a_durable_put_goes_first(tmp_path):
    keys, values = chunks(9, PAGE_SIZED_NS)
    store, disk = delayed_store(tmp_path)
    with store:
        for k, v in zip(keys[:8], values[:8]):
            store.put(k, v)
        assert store.stats().write_behind_queue == 8
        store.put(keys[8], values[8], durable=True)  # one worker: first in the queue, not ninth
        assert disk.calls.get("write", 0) == 1 and disk.contains(keys[8].id)
        store.delete(keys[:4])  # deleted before their copies were due: never written
        assert store.flush(timeout_s=30)
        assert disk.calls["write"] == 5
        assert not any(disk.contains(k.id) for k in keys[:4])
        assert all(disk.contains(k.id) for k in keys[4:])


def test_a_flush_and_a_drop_take_the_copies_they_wait_for_at_once(tmp_path):
    keys, values = chunks(8, PAGE_SIZED_NS)
    store, disk = delayed_store(tmp_path)
    with store:
        for k, v in zip(keys, values):
            store.put(k, v)
        assert Call(lambda: store.drop(keys[:4], "host")).outcome(timeout_s=30) == 4
        assert all(loads(store, k, v) for k, v in zip(keys[:4], values[:4]))  # from the disk
        assert store.flush(timeout_s=30)
        assert all(disk.contains(k.id) for k in keys)


def test_a_put_that_needs_host_ram_held_by_waiting_copies_takes_them_at_once(tmp_path):
    keys, values = chunks(24, PAGE_SIZED_NS)
    store, disk = delayed_store(tmp_path, host_pages=16)
    with store:
        blob = HEADER_BYTES + len(store.codec.encode(values[0]))
        assert store.first.capacity_bytes // store.first.footprint(blob) < len(keys)
        Call(lambda: [store.put(k, v) for k, v in zip(keys, values)]).outcome(timeout_s=30)
        assert store.flush(timeout_s=30)
        assert store.stats().write_behind_dropped == 0
        assert all(loads(store, k, v) for k, v in zip(keys, values))


def test_a_put_behind_a_waiting_copy_wakes_nobody(tmp_path):
    """Its copy falls due after the one the workers already wait for: waking them would cost
    the put the interpreter lock they take to find nothing due (~65 us of a small put's ~130)."""
    keys, values = chunks(8, PAGE_SIZED_NS)
    store, disk = delayed_store(tmp_path)
    with store:
        store.put(keys[0], values[0])  # into an empty queue: a worker must start waiting for it
        changed, woken = store.index.changed, []
        notify_all = changed.notify_all
        changed.notify_all = lambda: (woken.append(True), notify_all())
        try:
            for k, v in zip(keys[1:], values[1:]):
                store.put(k, v)
        finally:
            del changed.notify_all
        assert woken == []
        assert store.stats().write_behind_queue == 8
        assert store.flush(timeout_s=30) and all(disk.contains(k.id) for k in keys)


def test_copies_are_written_once_due_with_nobody_waiting_for_them(tmp_path):
    """The first copy of an empty queue wakes a worker, which waits until it is due and then
    finds the ones queued behind it."""
    keys, values = chunks(6, PAGE_SIZED_NS)
    store, disk = store_with_faulty_disk(tmp_path, 64, workers=2, delay_s=0.2)
    with store:
        for k, v in zip(keys[:3], values[:3]):
            store.put(k, v)
        wait_until(lambda: all(disk.contains(k.id) for k in keys[:3]), 30, "the first copies written")
        for k, v in zip(keys[3:], values[3:]):  # the workers went back to waiting without a timeout
            store.put(k, v)
        wait_until(lambda: all(disk.contains(k.id) for k in keys[3:]), 30, "the later copies written")
