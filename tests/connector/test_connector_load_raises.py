"""A synchronous load that raises (its scatter failed: on a GPU, the host-to-device copy out
of memory) fails the step. The step's other loads must be settled before it raises: a read
still in flight then scatters nothing, so no load writes the paged cache after the step
returned; and the engine must still close (its saver, loader threads and store)."""

import threading

import pytest

from connector import ConnectorConfig
from engine import LLM, EngineConfig, SamplingParams
from engine.testing import make_tiny_checkpoint
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.keys import chunk_keys
from kvstore.store import Store

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK, CHUNK = 4, 16
ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


class GatedReads:
    """The Store without lending (every chunk is read by a loader thread), holding the reads
    that name one of ``held`` at a gate until the test opens it."""

    def __init__(self, store: Store, held) -> None:
        self._store, self._held = store, {k.id for k in held}
        self.entered, self.gate = threading.Event(), threading.Event()

    def __getattr__(self, name):
        if name == "borrow":  # not a LendsChunks: loads go through get_into on the loader threads
            raise AttributeError(name)
        return getattr(self._store, name)

    def _hold(self, keys) -> None:
        if any(k.id in self._held for k in keys):
            self.entered.set()
            self.gate.wait(10)

    def get_into(self, key, out):
        self._hold([key])
        return self._store.get_into(key, out)

    def get_many_into(self, keys, outs):
        self._hold(keys)
        return self._store.get_many_into(keys, outs)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")
    return LLM(path, EngineConfig(num_blocks=64, block_size=BLOCK))


def run_failing_step(llm, tmp_path):
    """Two requests whose chunks the store holds, admitted in one synchronous step: the first
    one's scatter raises while the second one's read is still in flight. Returns the engine,
    the gated store, and the loads the second request scattered after the step returned."""
    a = [(7 * i + 3) % 250 for i in range(2 * CHUNK + 1)]
    b = [(11 * i + 5) % 250 for i in range(2 * CHUNK + 1)]
    store = Store(StoreConfig(host=HostTierConfig(capacity_bytes=16 << 20, page_bytes=64 << 10),
                              disk=DiskTierConfig(path=str(tmp_path / "d"), capacity_bytes=1, enabled=False)))
    producer = llm.with_config(kv_store=store, connector=ConnectorConfig(chunk_tokens=CHUNK))
    for prompt in (a, b):
        producer.add_request(prompt, ONE)
    while producer.has_unfinished():
        producer.step()
    assert producer.flush_saves()
    producer.close()
    ns = producer.connector.namespace
    keys_a, keys_b = chunk_keys(a, ns), chunk_keys(b, ns)
    assert store.lookup(keys_a) == 2 and store.lookup(keys_b) == 2

    gated = GatedReads(store, keys_b)
    e = llm.with_config(kv_store=gated, connector=ConnectorConfig(chunk_tokens=CHUNK, load_mode="sync",
                                                                 load_timeout_s=5.0))
    mover = e.connector.worker.mover
    scatter, returned, late = mover.scatter, threading.Event(), []

    def failing(buf, load):
        if load.key in keys_a:
            assert gated.entered.wait(10)  # b's read is in flight (on the other loader thread)
            raise RuntimeError("injected: host-to-device copy out of memory")
        if returned.is_set():
            late.append(load.key)
        scatter(buf, load)

    mover.scatter = failing
    e.add_request(a, ONE, arrival_time=0.0)  # loaded first: its failure is seen while b's read is held
    e.add_request(b, ONE, arrival_time=1.0)
    with pytest.raises(RuntimeError, match="injected"):
        e.step()
    returned.set()
    gated.gate.set()
    return e, store, late


def test_a_load_that_raises_leaves_no_load_of_its_step_writing_after_it(llm, tmp_path):
    e, store, late = run_failing_step(llm, tmp_path)
    try:
        e.connector.worker._loaders.shutdown(wait=True)  # every loader thread is done now
        assert late == [], "a load of the failed step scattered into the paged cache after the step returned"
    finally:
        try:
            e.close()
        except RuntimeError:
            pass
        store.close()


def test_an_engine_whose_load_raised_still_closes(llm, tmp_path):
    e, store, _ = run_failing_step(llm, tmp_path)
    try:
        e.close()  # raised the step's error again: saver and loader threads never stopped
        assert not e.connector.worker.saver._thread.is_alive()
    finally:
        store.close()
