"""A step whose connector work fails raises, and leaves nothing wrong behind: a layer-wise load
whose layer scatter fails must not let the step save chunks the forward computed over KV
that never arrived (the scatter's failure is raised before the step's saves), and a gather
that fails leaves no chunk claimed and no save buffer taken."""

import pytest
import torch

from connector import ConnectorConfig
from connector.metadata import ChunkSave
from engine import LLM, EngineConfig, SamplingParams
from engine.testing import make_tiny_checkpoint
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.keys import chunk_keys
from kvstore.store import Store

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK, CHUNK = 4, 16
ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def host_store(path):
    return Store(StoreConfig(host=HostTierConfig(capacity_bytes=16 << 20, page_bytes=64 << 10),
                             disk=DiskTierConfig(path=str(path), capacity_bytes=1, enabled=False)))


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")
    return LLM(path, EngineConfig(num_blocks=64, block_size=BLOCK))


def engine(llm, store, mode):
    return llm.with_config(kv_store=store, connector=ConnectorConfig(chunk_tokens=CHUNK, load_mode=mode))


def finish(e, prompt):
    e.add_request(prompt, ONE)
    while e.has_unfinished():
        e.step()


def test_a_failed_layer_scatter_saves_no_chunk_computed_over_it(llm, tmp_path):
    tokens = [(7 * i + 3) % 250 for i in range(3 * CHUNK + 3)]
    first, second = tokens[:2 * CHUNK + 3], tokens  # the second prompt hits chunks 0, 1; computes chunk 2
    with host_store(tmp_path / "a") as good, host_store(tmp_path / "b") as bad:
        # reference: the same two engines' work without a fault
        for store, fail in ((good, False), (bad, True)):
            producer = engine(llm, store, "sync")
            finish(producer, first)
            assert producer.flush_saves()
            producer.close()
            e = engine(llm, store, "layerwise")
            if fail:
                scatter_layer = e.connector.worker.mover.scatter_layer

                def failing(buf, load, layer):
                    if layer == 0:  # e.g. the device copy runs out of memory
                        raise RuntimeError("injected: layer scatter failed")
                    scatter_layer(buf, load, layer)

                e.connector.worker.mover.scatter_layer = failing
                e.add_request(second, ONE)
                with pytest.raises(RuntimeError, match="injected"):
                    e.step()
            else:
                finish(e, second)
            e.flush_saves()
            e.close()
        key = chunk_keys(second, e.connector.namespace)[2]
        (want,) = good.get([key])
        got = bad.get([key])
        # the store may lack chunk 2 (the step failed), but must never hold other bytes for it
        assert not got or torch.allclose(got[0], want, atol=1e-4), \
            "chunk 2 was saved with KV computed over layers that were never loaded"


def test_a_failed_gather_leaves_no_claim_and_no_buffer_behind(llm, tmp_path):
    """A gather that raised (on a GPU, out of memory for its temporary) left the chunks claimed
    so far claimed, and their buffers taken, for good: this engine never saved those chunks
    again (claim() refused them, uncounted), and each failure lost save buffers."""
    tokens = [(5 * i + 1) % 250 for i in range(3 * CHUNK + 1)]
    with host_store(tmp_path / "s") as store:
        e = engine(llm, store, "sync")
        worker = e.connector.worker
        gather, calls = worker.mover.gather, []

        def failing(block_ids, buf):
            calls.append(block_ids)
            if len(calls) == 2:
                raise RuntimeError("injected: gather failed")
            gather(block_ids, buf)

        worker.mover.gather = failing
        e.add_request(tokens, ONE)
        with pytest.raises(RuntimeError, match="injected"):
            while e.has_unfinished():
                e.step()
        assert worker.save_staging.outstanding == 0
        keys = chunk_keys(tokens, e.connector.namespace)
        saves = [ChunkSave(k, None, ()) for k in keys]
        assert all(worker.saver.claim(s) for s in saves), "a chunk stayed claimed: never saved again"
        for s in saves:
            worker.saver.unclaim(s)
        worker.mover.gather = gather
        e.close()
