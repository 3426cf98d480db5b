"""The GGUF weight cache beside the file: served the second time, bit-equal to a fresh
dequantisation, refused and rebuilt when stale or damaged, never half-written."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.assets import smollm2_gguf_path
from engine.models import loader


def write_tiny_gguf(path, seed: int = 0):
    """A 2-layer random Llama GGUF (Q8_0 projections, f32 norms) of a few hundred KB."""
    from gguf import GGMLQuantizationType, GGUFWriter, quantize

    rng = np.random.default_rng(seed)
    hidden, ffn, vocab = 64, 128, 96
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_context_length(256)
    writer.add_vocab_size(vocab)
    q8 = GGMLQuantizationType.Q8_0

    def add(name, *shape, quantized=True):
        data = rng.standard_normal(shape).astype(np.float32)
        if quantized:
            writer.add_tensor(name, quantize(data, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, data)

    add("token_embd.weight", vocab, hidden)
    add("output_norm.weight", hidden, quantized=False)
    for i in range(2):
        add(f"blk.{i}.attn_norm.weight", hidden, quantized=False)
        add(f"blk.{i}.ffn_norm.weight", hidden, quantized=False)
        for name, rows, cols in [("attn_q", hidden, hidden), ("attn_k", 32, hidden), ("attn_v", 32, hidden),
                                 ("attn_output", hidden, hidden), ("ffn_gate", ffn, hidden),
                                 ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)]:
            add(f"blk.{i}.{name}.weight", rows, cols)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def cache_of(path):
    return path.with_name(path.name + ".engine-fp32.safetensors")


def uncached(path, monkeypatch):
    with monkeypatch.context() as m:
        m.setenv("KVSTORE_WEIGHT_CACHE", "0")
        return loader.gguf_weights(path)


def assert_bit_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype == torch.float32, name
        assert torch.equal(a[name].view(torch.int32), b[name].view(torch.int32)), name


@pytest.fixture
def tiny_gguf(tmp_path):
    return write_tiny_gguf(tmp_path / "tiny.gguf")


def test_the_second_load_is_served_from_the_cache_bit_equal(tiny_gguf, monkeypatch):
    fresh_cfg, fresh = uncached(tiny_gguf, monkeypatch)
    assert not cache_of(tiny_gguf).exists()  # KVSTORE_WEIGHT_CACHE=0 writes nothing
    loader.gguf_weights(tiny_gguf)
    assert cache_of(tiny_gguf).exists()

    def no_parse(path):
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr(loader, "read_gguf", no_parse)
    cfg, weights = loader.gguf_weights(tiny_gguf)
    assert cfg == fresh_cfg
    assert_bit_equal(weights, fresh)


def test_a_cache_of_other_weights_is_rebuilt(tiny_gguf, monkeypatch):
    loader.gguf_weights(tiny_gguf)
    write_tiny_gguf(tiny_gguf, seed=1)  # same path and size, other content
    _, fresh = uncached(tiny_gguf, monkeypatch)
    _, weights = loader.gguf_weights(tiny_gguf)
    assert_bit_equal(weights, fresh)
    assert loader.read_weight_cache(cache_of(tiny_gguf), loader.model_fingerprint(tiny_gguf)) is not None


@pytest.mark.parametrize("damage", ["flip a weight byte", "truncate", "not safetensors"])
def test_a_damaged_cache_is_refused_and_rebuilt(tiny_gguf, monkeypatch, damage):
    _, fresh = loader.gguf_weights(tiny_gguf)
    cache = cache_of(tiny_gguf)
    data = bytearray(cache.read_bytes())
    if damage == "flip a weight byte":
        data[-5] ^= 0x40
    elif damage == "truncate":
        del data[-100:]
    else:
        data = bytearray(b"junk" * 100)
    cache.write_bytes(bytes(data))
    fingerprint = loader.model_fingerprint(tiny_gguf)
    assert loader.read_weight_cache(cache, fingerprint) is None
    _, weights = loader.gguf_weights(tiny_gguf)
    assert_bit_equal(weights, fresh)
    assert loader.read_weight_cache(cache, fingerprint) is not None


def test_builders_racing_leave_one_whole_cache_readable_like_the_gguf(tiny_gguf):
    tiny_gguf.chmod(0o640)
    threads = [threading.Thread(target=loader.gguf_weights, args=(tiny_gguf,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(p.name for p in tiny_gguf.parent.iterdir()) == ["tiny.gguf", "tiny.gguf.engine-fp32.safetensors"]
    assert loader.read_weight_cache(cache_of(tiny_gguf), loader.model_fingerprint(tiny_gguf)) is not None
    assert cache_of(tiny_gguf).stat().st_mode & 0o777 == 0o640


KILLED_WRITER = """
import os, sys
from pathlib import Path
import safetensors.torch
from engine.models import loader

def killed_writing(weights, filename, metadata=None):
    Path(filename).with_name(".tmpKiLLeD").write_bytes(b"half a cache")  # safetensors' own temporary
    os._exit(9)

def killed_renaming(src, dst):
    os._exit(9)

if sys.argv[2] == "in safetensors' write":
    safetensors.torch.save_file = killed_writing
else:
    loader.os.replace = killed_renaming
loader.gguf_weights(Path(sys.argv[1]))
"""


@pytest.mark.parametrize("moment", ["in safetensors' write", "before the rename"])
def test_the_next_write_removes_what_a_killed_writer_left(tiny_gguf, moment):
    """A cache write is ~500 MB on a real model: a writer killed midway must not leave that
    beside the GGUF for ever."""
    import subprocess
    import sys

    killed = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(tiny_gguf), moment])
    assert killed.returncode == 9
    assert len(list(tiny_gguf.parent.iterdir())) > 1  # the writer left something beside the GGUF
    loader.gguf_weights(tiny_gguf)
    assert sorted(p.name for p in tiny_gguf.parent.iterdir()) == ["tiny.gguf", "tiny.gguf.engine-fp32.safetensors"]


def test_only_temporaries_of_dead_writers_here_are_removed(tmp_path):
    """A live writer's temporary (this process's, or a process we may not signal), another
    host's (its pids are not ours to check) and names not of our pattern stay."""
    import socket
    import subprocess
    import sys

    from engine.cachefiles import remove_dead_temps

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    host = socket.gethostname()
    final = tmp_path / "tiny.gguf.engine-fp32.safetensors"
    stale = [f".{final.name}.{host}.{dead.stdout.strip()}.0123abcd.tmp"]
    kept = [f".{final.name}.{host}.{os.getpid()}.0123abcd.tmp", f".{final.name}.{host}.1.0123abcd.tmp",
            f".{final.name}.elsewhere.{dead.stdout.strip()}.0123abcd.tmp",
            f".other.gguf.engine-fp32.safetensors.{host}.{dead.stdout.strip()}.0123abcd.tmp",
            ".tmpAbC123", "tiny.gguf"]
    for name in stale + kept:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "stale-folder").mkdir()
    (tmp_path / "stale-folder" / ".tmpAbC123").write_bytes(b"x")
    (tmp_path / "stale-folder").rename(tmp_path / f".{final.name}.{host}.{dead.stdout.strip()}.4567cdef.tmp")
    remove_dead_temps(final)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


def test_smollm2_from_the_cache_is_the_uncached_model(monkeypatch):
    """The real Q4_1/Q8_0 model: every tensor bit-equal, and the same greedy tokens."""
    path = smollm2_gguf_path()
    config = EngineConfig(num_blocks=8, block_size=16, dtype="float32")
    loader.gguf_weights(path)  # builds the cache if this is the first load
    assert loader.read_weight_cache(cache_of(path), loader.model_fingerprint(path)) is not None
    greedy = SamplingParams(max_tokens=8, temperature=0)
    with LLM(path, config) as cached:
        with monkeypatch.context() as m:
            m.setenv("KVSTORE_WEIGHT_CACHE", "0")
            with LLM(path, config) as fresh:
                assert_bit_equal(cached.model.state_dict(), fresh.model.state_dict())
                prompt = "The capital of France is"
                assert cached.generate(prompt, greedy)[0].output_token_ids == \
                    fresh.generate(prompt, greedy)[0].output_token_ids


def test_loading_a_model_leaves_torch_dynamo_unimported(tiny_gguf):
    """Importing torch._dynamo costs 1.4 s, more than the whole cached load."""
    import subprocess
    import sys

    code = ("import sys; from engine.models.loader import load_model; load_model(sys.argv[1]); "
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'")
    subprocess.run([sys.executable, "-c", code, str(tiny_gguf)], check=True)


@pytest.fixture
def fake_conversion(tmp_path, monkeypatch):
    """transformers' GGUF conversion, faked with a tiny HF model (transformers reads no tiny
    GGUF tokenizer): the list of GGUF files converted, and the HF folder they become."""
    import transformers

    from engine.testing import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path / "hf")
    converted = []
    for cls in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        original = cls.from_pretrained

        def from_pretrained(path, *args, gguf_file=None, _original=original, **kwargs):
            if gguf_file is None:
                return _original(path, *args, **kwargs)
            converted.append(gguf_file)
            return _original(hf, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", from_pretrained)
    return converted, hf


def test_transformers_copy_converts_once_per_content(tiny_gguf, fake_conversion):
    """The probe's reference is transformers' conversion, made once and found by content."""
    import transformers

    from bench import probe_model
    from engine.testing import transformers_copy

    converted, hf = fake_conversion
    folder = transformers_copy(tiny_gguf)
    assert converted == ["tiny.gguf"] * 2
    assert all(f.stat().st_mode & 0o044 == 0o044 for f in folder.iterdir())  # a shared cache: others read it
    assert transformers_copy(tiny_gguf) == folder and len(converted) == 2
    loaded = probe_model.load_model(tiny_gguf)
    assert len(converted) == 2 and loaded.model_id == "tiny"
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf)
    ours, theirs = loaded.model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    write_tiny_gguf(tiny_gguf, seed=1)
    assert transformers_copy(tiny_gguf) != folder and len(converted) == 4
    assert not folder.exists()  # no load reads the old content's copy again


@pytest.mark.parametrize("damage", ["truncate the weights", "truncate the tokenizer", "no manifest"])
def test_a_transformers_copy_cut_short_is_rebuilt(tiny_gguf, fake_conversion, damage):
    """A copy whose files are not the size its manifest says (cut short on a disk, or made
    before manifests, so unchecked) is converted again, never loaded as is."""
    import transformers

    from engine.testing import transformers_copy

    converted, hf = fake_conversion
    folder = transformers_copy(tiny_gguf)
    whole = {p.name: p.read_bytes() for p in folder.iterdir()}
    if damage == "no manifest":
        (folder / "manifest.json").unlink()
    else:
        victim = folder / ("model.safetensors" if damage == "truncate the weights" else "tokenizer.json")
        victim.write_bytes(victim.read_bytes()[:-100])
    assert transformers_copy(tiny_gguf) == folder and len(converted) == 4
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == whole
    assert sorted(p.name for p in tiny_gguf.parent.iterdir()) == sorted(["hf", "tiny.gguf", folder.name])
    ours = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf).state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_writing_a_transformers_copy_removes_what_no_load_reads(tiny_gguf, fake_conversion):
    """Each is ~500 MB beside the GGUF: copies of content it had before, the unchecked
    ``.transformers-fp32`` of an earlier version, a converter's temporary whose process is
    gone. Nothing of another name goes, nor a symlink."""
    import socket
    import subprocess
    import sys

    from engine.models.loader import model_fingerprint
    from engine.testing import transformers_copy

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    name = f"tiny.gguf.transformers-{model_fingerprint(tiny_gguf).rsplit('-', 1)[1]}"
    superseded = ["tiny.gguf.transformers-fp32", "tiny.gguf.transformers-0123456789abcdef",
                  f".{name}.{socket.gethostname()}.{dead}.0123abcd.tmp"]
    others = ["other.gguf.transformers-0123456789abcdef", "tiny.gguf.transformers-mine",
              "tiny.gguf.transformers-0123456789abcdef.bak",
              f".{name}.{socket.gethostname()}.{os.getpid()}.0123abcd.tmp"]
    for folder in superseded + others:
        (tiny_gguf.parent / folder).mkdir()
        (tiny_gguf.parent / folder / "model.safetensors").write_bytes(b"x")
    (tiny_gguf.parent / "tiny.gguf.transformers-fedcba9876543210").symlink_to("tiny.gguf.transformers-mine")
    others.append("tiny.gguf.transformers-fedcba9876543210")
    folder = transformers_copy(tiny_gguf)
    assert sorted(p.name for p in tiny_gguf.parent.iterdir()) == sorted(["hf", "tiny.gguf", folder.name, *others])
    assert (tiny_gguf.parent / "tiny.gguf.transformers-mine" / "model.safetensors").exists()
