"""``LLM.stream``'s ``new_text`` pieces add up to the request's final text. They were sliced
at the old text's length, so (a) characters already streamed that a stop string later cut
off stayed in the stream (the start of the stop string), and (b) a character split over byte
tokens streamed as U+FFFD and was never corrected once its bytes completed it."""

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.testing import make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")
    return LLM(path, EngineConfig(num_blocks=64, block_size=4))


def streamed(llm, prompt, params):
    pieces, last = [], None
    for out in llm.stream(prompt, params):
        pieces.append(out.new_text)
        last = out
    return "".join(pieces), last


@pytest.mark.parametrize("prompt", ["0123456789", "hello world"])
def test_streamed_text_adds_up_to_the_final_text_with_a_stop_string(llm, prompt):
    text = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].text
    stop = text[3:5]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=[stop])
    got, last = streamed(llm, prompt, params)
    assert last.finish_reason == "stop" and last.text == text[:text.find(stop)]
    assert got == last.text  # it was: the stop string's first character streamed before the cut


def test_streamed_text_adds_up_to_the_final_text_across_split_characters(llm):
    """The tiny checkpoint's byte-level tokenizer gives every byte its own token, so outputs
    holding bytes >= 0x80 stream characters split over two or more steps."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for prompt in ["0123456789", "hello world", "xyz"]:
        got, last = streamed(llm, prompt, params)
        assert got == last.text, prompt
