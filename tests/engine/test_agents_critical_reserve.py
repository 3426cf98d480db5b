"""A non-critical request that can never fit beside the memory reserved for critical agents
must not wedge the engine. It was accepted by ``add_request`` (validation ignored the
reservation) or, grown by decoding, preempted; it then waited forever, and once nothing
else ran every ``step()`` raised "waiting requests cannot be admitted into an empty
KV cache" (docs/agents.md: the reservation; engine/llm.py: a bad request raises ValueError at
``add_request`` and leaves the engine serving the rest)."""

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.agent_config import AgentConfig
from engine.testing import make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def reserved_engine(path):
    # 16 blocks of 4 tokens, 8 of them only critical agents' requests may use
    return LLM(path, EngineConfig(num_blocks=16, block_size=4, admission_watermark=0.0,
                                  agents=AgentConfig(critical_reserve_fraction=0.5)))


def drain(llm, limit=400):
    for _ in range(limit):
        if not llm.has_unfinished():
            return
        llm.step()
        llm.scheduler.check_integrity()
    raise AssertionError("requests still unfinished")


def test_a_prompt_that_cannot_fit_beside_the_reservation_is_refused_or_served(tiny):
    llm = reserved_engine(tiny)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    try:
        big = llm.add_request(list(range(40)), params)  # 10 blocks: more than the 8 others may use
    except ValueError:
        big = None
    small = llm.add_request([1, 2, 3], params)
    drain(llm)  # it was: RuntimeError once only the big request was left waiting
    assert small.is_finished and (big is None or big.is_finished)


def test_a_preempted_request_that_grew_into_the_reservation_resumes(tiny):
    """Two non-critical requests decode side by side until the cache is full (decodes may use
    the reserved blocks); the newer is preempted holding 8 blocks. When the older one finishes,
    it must resume: it waited forever, and the next step raised."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    cold = LLM(tiny, EngineConfig(num_blocks=64, block_size=4))
    want = [cold.generate(p, params)[0].output_token_ids for p in ([5, 6, 7, 8], [9, 10, 11, 12])]
    llm = reserved_engine(tiny)
    a = llm.add_request([5, 6, 7, 8], params)
    b = llm.add_request([9, 10, 11, 12], params)
    drain(llm)
    assert b.metrics.num_preemptions > 0
    assert [a.output_token_ids, b.output_token_ids] == want
