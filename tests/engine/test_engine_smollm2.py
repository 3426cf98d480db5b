"""SmolLM2-135M (the same Q4_1 GGUF loaded by us and by transformers, fp32): greedy tokens must
match transformers token for token, run alone and batched, and the logits must agree closely."""

import pytest
import torch

from engine import SamplingParams
from engine.assets import smollm2_gguf_path
from engine.testing import transformers_reference
from real_models import smollm2

MAX_TOKENS = 6
QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "Why is the sky blue?",
    "Write a haiku about autumn leaves.", "Explain photosynthesis in one sentence.",
    "What is 12 times 7?", "Translate 'good morning' into Spanish.", "Who wrote Romeo and Juliet?",
    "Give me a tip for learning to code.", "What does a compiler do?",
]
RAW = [
    "1, 2, 3, 4,", "The quick brown fox", "def fibonacci(n):", "Once upon a time, in a small village,",
    "Paris is the capital of", "import numpy as np\n", "The three laws of thermodynamics are",
    "Q: What is the boiling point of water?\nA:",
    "In this article we describe a multi-tier key-value cache that stores attention keys and values "
    "across GPU memory, host memory, local disks and a shared file system, and we show that fetching "
    "them from whichever tier is free is faster than recomputing the prefill. The design is",
    "Roses are red, violets are blue,",
    "A long list of fruits: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, "
    "mango, nectarine, orange, papaya, quince, raspberry, strawberry, tangerine,",
    "Hello",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llm():
    return smollm2(num_blocks=256)


@pytest.fixture(scope="module")
def reference():
    return transformers_reference(smollm2_gguf_path())


@pytest.fixture(scope="module")
def prompts(llm):
    chats = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    return [llm.tokenizer.encode(p) for p in chats + RAW]


def test_greedy_matches_transformers_alone_and_batched(llm, reference, prompts):
    assert len(prompts) >= 20 and len({len(p) for p in prompts}) > 10
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    batched = llm.generate(prompts, params)
    for ids, out in zip(prompts, batched):
        ids_t = torch.tensor([ids])  # explicit mask: the chat prompts contain the pad/eos id 2
        hf = reference.generate(ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=MAX_TOKENS,
                                do_sample=False, eos_token_id=None, pad_token_id=2)[0, len(ids):].tolist()
        assert out.output_token_ids == hf, llm.tokenizer.decode(ids)
        assert llm.generate(ids, params)[0].output_token_ids == hf


def test_prefill_logits_match_transformers(llm, reference, prompts):
    for ids in (prompts[0], prompts[-4]):
        llm.add_request(ids, SamplingParams(max_tokens=1, temperature=0))
        (seq, logits), = llm.runner.run(llm.scheduler.schedule(0.0))
        llm.scheduler.finish(seq, "length")
        with torch.no_grad():
            expected = reference(torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(logits, expected, atol=2e-3, rtol=1e-3)


def test_chat_answer_is_sensible(llm):
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0))[0]
    assert "Paris" in out.text
    assert out.metrics.num_cached_tokens > 0  # the system prompt blocks were cached by earlier tests
