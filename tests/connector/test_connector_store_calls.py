"""What an engine's load asks of the Store: each key is looked up once (found and pinned in one
call) and read once, and nothing is written, in every load mode. Before, a layer-wise load
looked its keys up again inside the read (``Store.replicas`` ran a ``lookup`` first)."""

import collections
import functools
import threading

import pytest
import torch

from connector import ConnectorConfig
from engine import LLM, EngineConfig, SamplingParams
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.keys import ChunkKey
from kvstore.store import Store

CHUNK = 16
LOOKS_UP = {"lookup", "contains", "pin", "pin_leading"}
READS = {"borrow", "get_into", "get_many_into", "get", "get_with", "stream", "get_blob"}
WRITES = {"put", "put_blob", "put_claimed", "prefetch", "delete", "drop"}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, EngineConfig(num_blocks=96, block_size=4))


class StoreCalls:
    """Counts, per key, the Store's public calls that name it: every call (``any_depth``, the
    Store's calls to itself too) and the outermost ones only (``outer``: the connector's)."""

    def __init__(self, store: Store) -> None:
        self.any_depth: collections.Counter = collections.Counter()
        self.outer: collections.Counter = collections.Counter()
        self._depth = threading.local()
        for name in dir(store):
            if not name.startswith("_") and callable(getattr(store, name)):
                setattr(store, name, self._counting(name, getattr(store, name)))

    def _counting(self, name, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            named = [a for a in args if isinstance(a, ChunkKey)]
            named += [k for a in args if isinstance(a, (list, tuple)) for k in a if isinstance(k, ChunkKey)]
            for key in named:
                self.any_depth[name, key.id] += 1
                if depth == 0:
                    self.outer[name, key.id] += 1
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth
        return call


def run(llm, prompt):
    seq = llm.add_request(prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    while llm.has_unfinished():
        llm.step()
    assert llm.flush_saves()
    llm.close()
    return seq


@pytest.mark.parametrize("mode", ["sync", "async", "layerwise"])
def test_an_engine_load_looks_each_key_up_once_and_reads_it_once(llm, tmp_path, mode):
    prompt = list(range(5, 5 + 3 * CHUNK))
    config = StoreConfig(host=HostTierConfig(capacity_bytes=64 << 20, page_bytes=64 << 10),
                         disk=DiskTierConfig(path=str(tmp_path), capacity_bytes=256 << 20))
    with Store(config) as store:
        connector = ConnectorConfig(chunk_tokens=CHUNK, load_mode=mode)
        run(llm.with_config(kv_store=store, connector=connector), prompt)
        calls = StoreCalls(store)
        warm = run(llm.with_config(kv_store=store, connector=connector), prompt)
    assert warm.metrics.num_loaded_tokens == len(prompt)
    per_key = collections.defaultdict(dict)
    for (name, key_id), n in calls.any_depth.items():
        per_key[key_id][name] = n
    assert len(per_key) == 3
    for key_id, names in per_key.items():
        assert not names.keys() & WRITES, f"the load wrote: {names}"
        assert sum(n for name, n in names.items() if name in LOOKS_UP) == 1, names
        assert sum(calls.outer[name, key_id] for name in READS) == 1, names
