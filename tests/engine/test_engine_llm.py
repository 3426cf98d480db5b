"""End-to-end engine behaviour on tiny random checkpoints: parity with transformers, prefix
caching, chunked prefill, preemption, streaming, stop strings, sampling, bad input, CLI."""

import json

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.__main__ import main as engine_main
from engine.attention import decode_attention_sdpa
from engine.models.loader import unpermute_rows
from engine.testing import make_tiny_checkpoint
from kernels.paged_attention import paged_decode_attention_torch

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = ["hello world", "a", "the quick brown fox jumps over the lazy dog", "0123456789" * 3, "xyz"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def engine(path, **kw):
    kw.setdefault("num_blocks", 128)
    kw.setdefault("block_size", 4)
    return LLM(path, EngineConfig(**kw))


def hf_greedy(model, prompt_ids, n):
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_and_logits_match_transformers(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint(tmp_path / arch, arch, tie_word_embeddings=arch != "qwen2")
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    llm = engine(path)
    batched = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, batched):
        expected = hf_greedy(ref, out.prompt_token_ids, GREEDY.max_tokens)
        assert out.output_token_ids == expected, prompt
        assert llm.generate(prompt, GREEDY)[0].output_token_ids == expected
    ids = llm.tokenizer.encode(PROMPTS[2])
    llm.add_request(ids, GREEDY)
    (_, logits), = llm.runner.run(llm.scheduler.schedule(0.0))
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


def test_old_config_keys_load_the_same(tmp_path, tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    old = dict(cfg)
    old["rope_theta"] = old.pop("rope_parameters")["rope_theta"]
    old["torch_dtype"] = old.pop("dtype")
    folder = tmp_path / "old"
    folder.mkdir()
    for f in tiny.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / "config.json").write_text(json.dumps(old))
    assert engine(folder).generate(PROMPTS, GREEDY)[2].output_token_ids == \
        engine(tiny).generate(PROMPTS, GREEDY)[2].output_token_ids


def test_prefix_cache_hit_gives_cold_run_tokens(tiny):
    shared = "a shared system prompt that spans several blocks; "
    prompts = [shared + "first question", shared + "second one", shared + "first question"]
    cold = engine(tiny, enable_prefix_caching=False)
    expected = [cold.generate(p, GREEDY)[0].output_token_ids for p in prompts]
    warm = engine(tiny)
    outs = [warm.generate(p, GREEDY)[0] for p in prompts]
    assert [o.output_token_ids for o in outs] == expected
    assert outs[0].metrics.num_cached_tokens == 0
    assert outs[1].metrics.num_cached_tokens >= len(shared) - 4
    # an exact repeat reuses everything but the block holding the last prompt token
    n = len(outs[2].prompt_token_ids)
    assert outs[2].metrics.num_cached_tokens == (n - 1) // 4 * 4
    assert outs[2].metrics.num_prefilled_tokens == n - outs[2].metrics.num_cached_tokens


def test_chunked_prefill_matches_unchunked(tiny):
    whole = engine(tiny, max_num_batched_tokens=512).generate(PROMPTS, GREEDY)
    for budget in (2, 5):  # 2: single-token chunks in mid-prompt run beside decodes
        chunked = engine(tiny, max_num_batched_tokens=budget).generate(PROMPTS, GREEDY)
        assert [o.output_token_ids for o in chunked] == [o.output_token_ids for o in whole]


def test_preemption_and_resume_match_uninterrupted(tiny):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    roomy = engine(tiny).generate(PROMPTS, params)
    tight_llm = engine(tiny, num_blocks=24, admission_watermark=0.0)
    tight = tight_llm.generate(PROMPTS, params)
    assert [o.output_token_ids for o in tight] == [o.output_token_ids for o in roomy]
    assert sum(o.metrics.num_preemptions for o in tight) > 0
    assert tight_llm.block_manager.num_free == 24


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny):
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, top_k=50, seed=7)
    a = engine(tiny).generate(PROMPTS[0], params)[0].output_token_ids
    b = engine(tiny).generate(PROMPTS, params)[0].output_token_ids
    assert a == b
    c = engine(tiny).generate(PROMPTS[0], SamplingParams(max_tokens=10, temperature=0.8, seed=8))
    assert len(c[0].output_token_ids) == 10


def test_streaming_yields_every_token_once(tiny):
    llm = engine(tiny)
    final = {o.request_id: o for o in engine(tiny).generate(PROMPTS[:3], GREEDY)}
    pieces = {}
    for out in llm.stream(PROMPTS[:3], GREEDY):
        pieces.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert sorted(map(len, pieces.values())) == [12, 12, 12]
    assert sorted(pieces.values()) == sorted(o.output_token_ids for o in final.values())


def test_stop_string_truncates_text(tiny):
    llm = engine(tiny)
    text = llm.generate("0123456789", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].text
    stop = text[3:5]
    out = llm.generate("0123456789", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.find(stop)]


def test_metrics_are_filled(tiny):
    out = engine(tiny).generate("hello world", GREEDY)[0]
    m = out.metrics
    assert m.ttft is not None and m.ttft >= 0
    assert m.tpot is not None and m.tpot >= 0
    assert m.num_prompt_tokens == len(out.prompt_token_ids)
    assert m.num_output_tokens == 12 and out.finish_reason == "length"


def test_bad_requests_raise_and_engine_keeps_serving(tiny):
    llm = engine(tiny)
    good = llm.add_request("serve me", GREEDY, request_id="good")
    with pytest.raises(ValueError, match="request id 'good' is already in use"):
        llm.add_request("me too", GREEDY, request_id="good")
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.add_request("", GREEDY)
    with pytest.raises(ValueError, match="prompt too long"):
        llm.add_request("x" * 600, GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.add_request([1, 2, 10**6], GREEDY)
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        llm.generate(["fine", ""], GREEDY)
    with pytest.raises(ValueError, match="max_tokens must be positive"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="KV slots"):
        engine(tiny, num_blocks=8).add_request("hello", SamplingParams(max_tokens=100))
    outs = llm.generate(["and me"], GREEDY)
    assert len(outs[0].output_token_ids) == 12
    while not good.is_finished:
        llm.step()
    assert len(good.output_token_ids) == 12


def test_bad_checkpoints_name_the_problem(tmp_path, tiny):
    from safetensors.torch import load_file, save_file

    def copy(name):
        folder = tmp_path / name
        folder.mkdir()
        for f in tiny.iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        return folder

    unknown = copy("unknown")
    cfg = json.loads((unknown / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (unknown / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model architecture 'GPT2LMHeadModel'"):
        LLM(unknown)

    missing = copy("missing")
    weights = load_file(missing / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, missing / "model.safetensors")
    with pytest.raises(ValueError, match="missing tensors: model.layers.1.mlp.up_proj.weight"):
        LLM(missing)

    mismatch = copy("mismatch")
    cfg = json.loads((mismatch / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (mismatch / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"gate_proj.weight has shape \(128, 64\), the config implies \(96, 64\)"):
        LLM(mismatch)

    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(tmp_path / "nowhere")


def test_decode_fast_path_matches_kernel_reference():
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(2, 10, 4, 2, 16).unbind(0)
    query = torch.randn(3, 6, 16)
    tables = torch.tensor([[3, 1, 7], [0, 0, 0], [9, 2, 0]], dtype=torch.int32)
    lens = torch.tensor([11, 2, 5], dtype=torch.int32)
    expected = paged_decode_attention_torch(query, k_cache, v_cache, tables, lens, 0.25)
    torch.testing.assert_close(decode_attention_sdpa(query, k_cache, v_cache, tables, lens, 0.25), expected)


def test_unpermute_inverts_llama_cpp_permutation():
    heads, dim = 3, 8
    w = torch.randn(heads * dim, 5)
    permuted = w.reshape(heads, 2, dim // 2, 5).transpose(1, 2).reshape(w.shape)  # llama.cpp's convert
    torch.testing.assert_close(unpermute_rows(permuted, heads), w)


def test_cli_generate(tiny, capsys):
    assert engine_main(["generate", "--model", str(tiny), "--prompt", "hi", "--prompt", "yo",
                        "--max-tokens", "3", "--json", "--chat", "--block-size", "4"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["output_tokens"] for line in lines] == [3, 3]
    assert engine_main(["generate", "--model", str(tiny), "--prompt", "", "--max-tokens", "3"]) == 2
    assert "prompt is empty" in capsys.readouterr().err


def test_bad_gguf_names_the_problem(tmp_path):
    from engine.config import ModelConfig

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        LLM(junk)
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        ModelConfig.from_gguf({"general.architecture": "gpt2"}, has_output_weight=True)
    with pytest.raises(ValueError, match="GGUF metadata lacks llama.block_count"):
        ModelConfig.from_gguf({"general.architecture": "llama", "llama.attention.head_count": 4,
                               "llama.embedding_length": 64, "llama.feed_forward_length": 128,
                               "llama.vocab_size": 100},
                              has_output_weight=True)
