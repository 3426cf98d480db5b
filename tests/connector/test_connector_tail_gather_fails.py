"""A paused session's tail is gathered out of the paged cache into a save buffer
(``WorkerConnector.save_tail``). A gather that raises (on a GPU, out of memory for its
temporary) must leave the tail's key unclaimed and the buffer given back, as a step's
gathers do: else the tail can never be saved again, and every failure loses one of the
bounded save buffers, until no save at all can be taken."""

import pytest

from connector import ConnectorConfig
from connector.metadata import ChunkSave
from engine import LLM, EngineConfig, SamplingParams
from engine.agent_config import AgentConfig
from engine.testing import make_tiny_checkpoint
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.keys import chunk_keys
from kvstore.store import Store

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK, CHUNK = 4, 16
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")
    return LLM(path, EngineConfig(num_blocks=64, block_size=BLOCK))


def test_a_failed_tail_gather_leaves_no_claim_and_no_buffer_behind(llm, tmp_path):
    cfg = StoreConfig(host=HostTierConfig(capacity_bytes=16 << 20, page_bytes=64 << 10),
                      disk=DiskTierConfig(path=str(tmp_path / "d"), capacity_bytes=1, enabled=False))
    with Store(cfg) as store:
        e = llm.with_config(kv_store=store, connector=ConnectorConfig(chunk_tokens=CHUNK),
                            agents=AgentConfig(policy="offload"))
        prompt = [(7 * i + 3) % 250 for i in range(CHUNK + 2 * BLOCK + 1)]  # with 4 of 5 outputs: a 3-block tail
        e.add_request(prompt, GREEDY, session="a")
        while e.has_unfinished():
            e.step()
        assert e.flush_saves()
        worker = e.connector.worker
        gather, tails = worker.mover.gather, []

        def failing(block_ids, buf):
            tails.append(tuple(block_ids))
            raise RuntimeError("injected: gather failed")

        worker.mover.gather = failing
        with pytest.raises(RuntimeError, match="injected"):
            e.pause("a", 10.0)  # offload: the tail is gathered and put, then the blocks go
        worker.mover.gather = gather
        assert tails, "the pause gathered no tail"
        assert worker.save_staging.outstanding == 0, "the tail's save buffer was never given back"
        session = e.sessions.sessions["a"]
        key = e.connector.scheduler.tails.plan("a", session.token_ids, len(session.token_ids),
                                               chunk_keys(session.token_ids, e.connector.namespace)).key
        save = ChunkSave(key, None, ())
        assert worker.saver.claim(save), "the tail stayed claimed: it can never be saved again"
        worker.saver.unclaim(save)
        e.close()
