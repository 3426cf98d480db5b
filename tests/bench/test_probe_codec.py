"""The codec quality probe end to end on a tiny random Llama built at test time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import probe_codec
from bench.cli import main
from engine.models.loader import model_fingerprint
from kvstore.store.placement import VERDICT_SCHEMA

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A 2-layer Llama (head_dim 64, like real models) and a word-level tokenizer of the probe text."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    words = sorted(set(probe_codec.DEFAULT_TEXT.read_text(encoding="utf-8").split()))
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(directory)
    config = transformers.LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def test_probe_writes_verdicts_and_raw_is_exact(tiny_llama, tmp_path, capsys):
    out = tmp_path / "verdicts.json"
    argv = ["probe-codec", "--model", str(tiny_llama), "--tokens", "96", "--continuation", "32"]
    argv += ["--chunk-tokens", "64", "--codecs", "raw,lz4,int8,int4,mixed50", "--out", str(out)]
    assert main(argv) == 0
    verdicts = json.loads(out.read_text())
    assert verdicts["schema"] == VERDICT_SCHEMA
    assert verdicts["model"] == tiny_llama.name
    assert verdicts["model_id"] == model_fingerprint(tiny_llama)  # the id the engine's namespaces carry
    assert verdicts["prefix_tokens"] == 96 and verdicts["continuation_tokens"] == 32
    assert set(verdicts["thresholds"]) == {"max_ppl_change_pct", "min_top1_agreement_pct"}
    assert verdicts["reference_ppl"] > 1
    assert list(verdicts["codecs"]) == ["raw", "lz4", "int8", "int4", "mixed50"]
    assert set(verdicts["baselines"]) == {"naive50-random", "naive50-truncate"}
    for name, v in {**verdicts["codecs"], **verdicts["baselines"]}.items():
        assert set(v) >= {"lossless", "size_ratio", "ppl", "ppl_change_pct", "top1_agreement_pct", "kl_divergence", "allowed"}, name
        assert isinstance(v["allowed"], bool)
    for name in ("raw", "lz4"):
        exact = verdicts["codecs"][name]
        assert exact["ppl_change_pct"] == 0.0 and exact["top1_agreement_pct"] == 100.0 and exact["allowed"]
        assert exact["kl_divergence"] == 0.0
    assert verdicts["codecs"]["int8"]["codec_id"] == 2
    assert verdicts["codecs"]["mixed50"]["size_ratio"] <= 0.5
    captured = capsys.readouterr()
    assert "raw" in captured.out
    # a run of minutes with a real model says where it is: each phase, then the codecs scored
    assert "probe-codec: loading" in captured.err and "probe-codec: the reference" in captured.err
    assert "codecs scored naive50-truncate: 7/7 (100%)" in captured.err.splitlines()[-1]


def test_probe_rejects_unknown_codecs_and_short_texts(tiny_llama, capsys):
    assert main(["probe-codec", "--model", str(tiny_llama), "--codecs", "nope"]) == 2
    assert main(["probe-codec", "--model", str(tiny_llama), "--tokens", "100000"]) == 2
    assert "tokens" in capsys.readouterr().err


def test_probe_rejects_paths_that_hold_no_model(tmp_path):
    assert main(["probe-codec", "--model", str(tmp_path)]) == 2
    (tmp_path / "config.json").write_text("{}")
    assert main(["probe-codec", "--model", str(tmp_path)]) == 2
