"""The saver against a real Store: a put the store refuses for want of room is a dropped
save, counted, and the connector stays on (loads go on); any other failure is an outage."""

import grpc
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

NS = Namespace("saver-model", 2, 2, 32, chunk_tokens=32)  # 16 KiB fp16 chunks


def saver_on(store):
    stats, availability = StatsRecorder(), Availability(backoff_s=30.0)
    pool = StagingPool(NS.chunk_shape, NS.torch_dtype, pin_memory=False, keep=4)
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
    keys = chunk_keys(list(range(8 * 32)), NS)
    with Store(store_config(tmp_path, host=4 * (NS.chunk_bytes + PAGE), disk=None)) as store:
        saver, pool, availability, stats = saver_on(store)
        save(saver, pool, keys[:4])
        assert store.pin(keys[:4], 30.0) == 4  # host RAM, the only tier, is now all pinned
        save(saver, pool, keys[4:])
        snapshot = stats.snapshot()
        assert snapshot.saved_chunks == 4 and snapshot.dropped_saves == 4 and snapshot.failed_saves == 0
        assert availability.available() and availability.outages == 0
        saver.close()


def test_a_store_that_fails_otherwise_is_an_outage(tmp_path):
    keys = chunk_keys(list(range(2 * 32)), NS)
    with Store(store_config(tmp_path, disk=None)) as store:
        saver, pool, availability, stats = saver_on(store)
    save(saver, pool, keys)  # the store is closed
    assert stats.snapshot().failed_saves == 2 and not availability.available() and availability.outages == 1
    saver.close()


def test_push_back_through_the_daemon_is_its_resource_exhausted_status():
    assert pushed_back(DaemonError(grpc.StatusCode.RESOURCE_EXHAUSTED, "tier host is full"))
    assert not pushed_back(DaemonError(grpc.StatusCode.UNAVAILABLE, "connection refused"))
    assert not pushed_back(ConnectionError("gone"))
