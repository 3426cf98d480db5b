"""The saver against a real Store: a put the store refuses for want of room is a dropped
save, counted, and the connector stays on (loads go on); any other failure is an outage; a
chunk the store's codec refuses is one failed save. Staging buffers taken during a forward
are written by store reads on other threads."""

import threading

import grpc
import torch
from helpers import PAGE, store_config

from connector.availability import Availability
from connector.metadata import ChunkSave
from connector.saver import Saver
from connector.staging import StagingPool
from connector.stats import StatsRecorder
from kvstore.api import pushed_back
from kvstore.client import DaemonError
from kvstore.keys import Namespace, chunk_keys
from kvstore.store import Store

SAVER_NS = Namespace("saver-model", 2, 2, 32, chunk_tokens=32)  # 16 KiB fp16 chunks


def saver_on(store):
    stats, availability = StatsRecorder(), Availability(backoff_s=30.0)
    pool = StagingPool(SAVER_NS.chunk_shape, SAVER_NS.torch_dtype, pin_memory=False, keep=4)
    return Saver(store, pool, availability, stats), pool, availability, stats


def save(saver, pool, keys):
    items = []
    for i, key in enumerate(keys):
        buf = pool.take()
        buf.fill_(float(i))
        items.append((ChunkSave(key, keys[i - 1] if i else None, (), i), buf))
    saver.submit(items)
    assert saver.flush(10.0)


def test_a_store_full_of_pinned_chunks_drops_saves_and_stays_on(tmp_path):
    keys = chunk_keys(list(range(8 * 32)), SAVER_NS)
    with Store(store_config(tmp_path, host=4 * (SAVER_NS.chunk_bytes + PAGE), disk=None)) as store:
        saver, pool, availability, stats = saver_on(store)
        save(saver, pool, keys[:4])
        assert store.pin(keys[:4], 30.0) == 4  # host RAM, the only tier, is now all pinned
        save(saver, pool, keys[4:])
        snapshot = stats.snapshot()
        assert snapshot.saved_chunks == 4 and snapshot.dropped_saves == 4 and snapshot.failed_saves == 0
        assert availability.available() and availability.outages == 0
        saver.close()


def test_a_store_that_fails_otherwise_is_an_outage(tmp_path):
    keys = chunk_keys(list(range(2 * 32)), SAVER_NS)
    with Store(store_config(tmp_path, disk=None)) as store:
        saver, pool, availability, stats = saver_on(store)
    save(saver, pool, keys)  # the store is closed
    assert stats.snapshot().failed_saves == 2 and not availability.available() and availability.outages == 1
    saver.close()


def test_push_back_through_the_daemon_is_its_resource_exhausted_status():
    assert pushed_back(DaemonError(grpc.StatusCode.RESOURCE_EXHAUSTED, "tier host is full"))
    assert not pushed_back(DaemonError(grpc.StatusCode.UNAVAILABLE, "connection refused"))
    assert not pushed_back(ConnectionError("gone"))


def test_a_chunk_the_codec_refuses_is_a_failed_save_and_the_saver_goes_on(tmp_path):
    """A lossy codec refuses KV holding inf or NaN (an fp16 overflow). The saver took that
    ValueError for a chunk that does not fit its namespace, a bug, and kept it as its error,
    which the worker raises at every later step: one request's overflowed value stopped the
    engine for every request, for good."""
    keys = chunk_keys(list(range(3 * 32)), SAVER_NS)
    with Store(store_config(tmp_path, host=16 * (SAVER_NS.chunk_bytes + PAGE), disk=None, codec="int8")) as store:
        saver, pool, _, stats = saver_on(store)
        try:
            bad = pool.take()
            bad.normal_()
            bad[1, 0, 5, 0, 3] = float("inf")
            saver.submit([(ChunkSave(keys[0], None, (), 0), bad)])
            assert saver.flush(10.0)
            good = pool.take()
            good.normal_()
            saver.submit([(ChunkSave(keys[1], None, (), 0), good)])
            assert saver.flush(10.0)
            assert saver.error is None, f"the saver keeps {saver.error!r}: every later step raises it"
            snapshot = stats.snapshot()
            assert snapshot.saved_chunks == 1 and snapshot.failed_saves == 1
            assert store.lookup([keys[1]]) == 1 and store.lookup([keys[0]]) == 0
        finally:
            saver.close()


def test_a_staging_buffer_taken_during_a_forward_can_be_read_into_by_a_loader_thread(tmp_path):
    """A synchronous load runs on the engine thread inside the forward's inference mode, and a
    buffer the pool made there was an inference tensor; given back and taken by a loader
    thread (outside inference mode), a store read that decodes into it in place raised, which
    the load counts as a store outage: the connector went off for its back-off."""
    keys = chunk_keys(list(range(32)), SAVER_NS)
    value = torch.randn(SAVER_NS.chunk_shape).to(SAVER_NS.torch_dtype)
    with Store(store_config(tmp_path, host=16 * (SAVER_NS.chunk_bytes + PAGE), disk=None)) as store:
        store.put(keys[0], value, codec="int8")
        pool = StagingPool(SAVER_NS.chunk_shape, SAVER_NS.torch_dtype, pin_memory=False, keep=4)
        with torch.inference_mode():
            pool.give(pool.take())
        errors = []

        def loader():
            buf = pool.take()
            try:
                assert store.get_into(keys[0], buf)
            except Exception as exc:
                errors.append(exc)

        thread = threading.Thread(target=loader)
        thread.start()
        thread.join()
        assert not errors, errors
