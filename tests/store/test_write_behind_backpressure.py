"""Write-behind's backpressure engages only when host RAM would fill with chunks whose copies
are not done, or a replica tier is stalled; never at a fixed fraction of host RAM (issue #37).

With the default configuration, a burst of 12 puts of 32 MiB into host RAM sized for them
took 15 ms each until a quarter of host RAM waited for its disk copies, then up to 4.6 s
each: every put waited for the disk, though host RAM had room for all of them. These tests
hold the disk's writes at a gate instead of timing puts: what fits in host RAM must be put
while the disk writes nothing; a put that would overfill host RAM with such chunks waits
for the disk (and does not fail); nothing is lost once the disk goes on; and a disk that
hangs past ``write_behind.stall_s`` gives host RAM back to puts.
"""

from __future__ import annotations

import pytest
import torch

import kvstore.store.write_behind
from faults import Call, Gate, ManualClock, wait_until
from helpers import chunks, same, store_with_faulty_disk
from kvstore.blob import HEADER_BYTES
from kvstore.keys import Namespace
from kvstore.store import Store
from tiers.base import TierUnavailable

# a chunk fills one host page (3840 bytes of payload and its header in 4 KiB), so that the
# bytes waiting for copies are host RAM's pages, as with real chunks
PAGE_SIZED_NS = Namespace("test-model", num_layers=2, num_kv_heads=2, head_dim=30, chunk_tokens=8)


def loads(store: Store, key, value) -> bool:
    out = torch.empty_like(value)
    return store.get_into(key, out) and same(out, value)


def host_slots(store: Store, value) -> int:
    """How many chunks like ``value`` host RAM holds."""
    blob = HEADER_BYTES + len(store.codec.encode(value))
    return store.first.capacity_bytes // store.first.footprint(blob)


def test_a_burst_that_fits_in_host_ram_is_put_while_the_disk_writes_nothing(tmp_path):
    keys, values = chunks(48, PAGE_SIZED_NS)
    store, disk = store_with_faulty_disk(tmp_path, host_pages=64)
    with store:
        assert len(keys) <= host_slots(store, values[0]) < 2 * len(keys)
        blocked = disk.gates["write"] = Gate()
        try:
            Call(lambda: [store.put(k, v) for k, v in zip(keys, values)]).outcome(timeout_s=30)
            assert disk.calls.get("write", 0) <= store.config.write_behind.workers  # the rest wait for the disk
            assert store.stats().write_behind_queue == len(keys)
        finally:
            blocked.open()
        assert store.flush(timeout_s=30)
        assert store.stats().write_behind_dropped == 0
        assert all(disk.contains(k.id) for k in keys)
        store.drop(keys, "host")
        assert all(loads(store, k, v) for k, v in zip(keys, values))


def test_a_put_waits_for_the_disk_once_host_ram_would_fill_with_chunks_waiting_for_copies(tmp_path):
    keys, values = chunks(17, PAGE_SIZED_NS)
    store, disk = store_with_faulty_disk(tmp_path, host_pages=16)
    with store:
        room = host_slots(store, values[0])
        assert room == len(keys) - 1
        blocked = disk.gates["write"] = Gate()
        try:
            Call(lambda: [store.put(k, v) for k, v in zip(keys[:room], values[:room])]).outcome(timeout_s=30)
            one_more = Call(lambda: store.put(keys[room], values[room]))
            one_more.join(0.5)  # on the fixed code this wait always runs out
            assert one_more.is_alive(), "a put overfilled host RAM, or evicted a chunk whose copy is not done"
        finally:
            blocked.open()
        one_more.outcome(timeout_s=30)  # the disk went on: the put gets room, and no TierFull
        assert store.flush(timeout_s=30)
        assert store.stats().write_behind_dropped == 0
        assert all(disk.contains(k.id) for k in keys)
        assert all(loads(store, k, v) for k, v in zip(keys, values))


def test_copies_waiting_for_a_stalled_disk_give_their_host_ram_back_to_puts(tmp_path, monkeypatch):
    """A hung disk holds host RAM full of chunks waiting for it; once it is stalled, a put that
    needs room drops those copies (counted, like a copy skipped at put time) instead of
    failing every put while the disk hangs. The copy running on the hung disk keeps its chunk.
    Write-behind's clock moves only when the test moves it: the disk stalls at that moment."""
    clock = ManualClock()
    monkeypatch.setattr(kvstore.store.write_behind, "time", clock)
    keys, values = chunks(24, PAGE_SIZED_NS)
    store, disk = store_with_faulty_disk(tmp_path, host_pages=16, workers=1, stall_s=5.0, delay_s=0)
    with store:
        room = host_slots(store, values[0])
        hang = disk.gates["write"] = Gate()
        try:
            Call(lambda: [store.put(k, v) for k, v in zip(keys[:room], values[:room])]).outcome(timeout_s=30)
            assert hang.entered.wait(10)
            assert store.stats().write_behind_dropped == 0
            clock.advance(6.0)  # the disk's copy in flight made no progress for stall_s
            Call(lambda: [store.put(k, v) for k, v in zip(keys[room:], values[room:])]).outcome(timeout_s=30)
            assert store.stats().write_behind_dropped == len(keys) - 1  # shed, or skipped at put time
            assert all(loads(store, k, v) for k, v in zip(keys[room:], values[room:]))
            assert loads(store, keys[0], values[0])  # its copy runs: it stays
            with pytest.raises(TierUnavailable, match="disk: write-behind is stalled"):
                store.put(keys[-1], values[-1], durable=True)
        finally:
            hang.open()
        assert store.flush(timeout_s=30)
        wait_until(lambda: disk.contains(keys[0].id), what="the copy that ran on the hung disk")
        store.put(keys[-1], values[-1], durable=True)  # no longer stalled


def test_copies_waiting_for_a_stalled_disk_stay_queued_while_puts_find_room(tmp_path, monkeypatch):
    """Stalled is no reason to drop the copies already queued: only a put that needs their
    chunks' room sheds them. While host RAM has room they wait, and a disk that goes on
    writes them all; the copy of a put made meanwhile is skipped (the disk was stalled)."""
    clock = ManualClock()
    monkeypatch.setattr(kvstore.store.write_behind, "time", clock)
    keys, values = chunks(6, PAGE_SIZED_NS)
    store, disk = store_with_faulty_disk(tmp_path, host_pages=16, workers=1, stall_s=5.0, delay_s=0)
    with store:
        hang = disk.gates["write"] = Gate()
        try:
            Call(lambda: [store.put(k, v) for k, v in zip(keys[:5], values[:5])]).outcome(timeout_s=30)
            assert hang.entered.wait(10)
            clock.advance(6.0)  # the disk is stalled
            store.put(keys[5], values[5])  # host RAM has room: nothing is shed
            assert store.stats().write_behind_dropped == 1
            assert store.stats().write_behind_queue == 5
        finally:
            hang.open()
        assert store.flush(timeout_s=30)
        assert store.stats().write_behind_dropped == 1
        assert all(disk.contains(k.id) for k in keys[:5])
        assert not disk.contains(keys[5].id)


def test_a_read_promoting_a_chunk_into_host_ram_does_not_shed_copies_waiting_for_a_stalled_disk(tmp_path, monkeypatch):
    """Only a put may take the room of chunks whose copies wait for a stalled tier: a read's
    promotion into host RAM is a cache's convenience, and is skipped when host RAM is full
    of such chunks rather than dropping their copies."""
    clock = ManualClock()
    monkeypatch.setattr(kvstore.store.write_behind, "time", clock)
    keys, values = chunks(24, PAGE_SIZED_NS)
    store, disk = store_with_faulty_disk(tmp_path, host_pages=16, workers=1, stall_s=5.0, delay_s=0)
    with store:
        room = host_slots(store, values[0])
        store.put(keys[0], values[0])
        assert store.flush(timeout_s=30)
        store.drop(keys[:1], "host")
        hang = disk.gates["write"] = Gate()
        try:
            Call(lambda: [store.put(k, v) for k, v in zip(keys[1:room + 1], values[1:room + 1])]).outcome(timeout_s=30)
            assert hang.entered.wait(10)
            clock.advance(6.0)  # the disk is stalled
            assert loads(store, keys[0], values[0])  # read from the disk, not promoted
            assert store.stats().write_behind_dropped == 0
            assert store.stats().write_behind_queue == room
        finally:
            hang.open()
        assert store.flush(timeout_s=30)
        assert all(disk.contains(k.id) for k in keys[:room + 1])
