"""The engine's model id (``engine.models.loader.model_fingerprint``) is part of every key, so
two checkpoints must never share one. It used to digest only the first and last MiB of each
weight file: two checkpoints that differ only in between (a fine-tune of some middle layers,
another revision of them) got the same model id, and an engine on one loaded the other's KV
from the store as hits (wrong bytes), and computed garbage on it."""

import json
import shutil
import struct

import numpy as np
import pytest

from connector import ConnectorConfig
from engine import LLM, EngineConfig, SamplingParams
from engine.models.loader import model_fingerprint
from engine.testing import make_tiny_checkpoint
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.store import Store

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
CHUNK, BLOCK = 16, 4
MIB = 1 << 20

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def edit_middle_tensor(folder):
    """Another revision of the k projection nearest the file's middle, in place (same size,
    same header): the KV of that layer changes."""
    f = folder / "model.safetensors"
    raw = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    tensors = {k: v for k, v in json.loads(raw[8:8 + n]).items() if k.endswith("k_proj.weight")}
    name = min(tensors, key=lambda k: abs(8 + n + tensors[k]["data_offsets"][0] - len(raw) // 2))
    meta = tensors[name]
    start, end = (8 + n + o for o in meta["data_offsets"])
    assert meta["dtype"] == "F32" and MIB <= start and end <= len(raw) - MIB  # outside the digested head and tail
    w = np.frombuffer(bytes(raw[start:end]), dtype="<f4")
    raw[start:end] = (w[::-1] * 3.0).astype("<f4").tobytes()
    f.write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    a = make_tiny_checkpoint(root / "llama", "llama", num_layers=24)
    b = root / "other" / "llama"  # the same folder name: a fine-tune of the same base, saved alike
    shutil.copytree(a, b)
    edit_middle_tensor(b)
    return a, b


def test_checkpoints_with_other_weights_get_other_model_ids(checkpoints):
    a, b = checkpoints
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()
    assert model_fingerprint(a) != model_fingerprint(b)


def test_an_engine_never_loads_kv_another_checkpoint_saved(checkpoints, tmp_path):
    a, b = checkpoints
    prompt = list(range(7, 7 + 2 * CHUNK + 3))
    cfg = StoreConfig(host=HostTierConfig(capacity_bytes=64 << 20, page_bytes=64 << 10),
                      disk=DiskTierConfig(path=str(tmp_path / "disk"), capacity_bytes=64 << 20))
    engine_cfg = dict(num_blocks=40, block_size=BLOCK)
    cold_b = LLM(b, EngineConfig(**engine_cfg)).generate([prompt], GREEDY)[0].output_token_ids
    with Store(cfg) as store:
        llm_a = LLM(a, EngineConfig(**engine_cfg, connector=ConnectorConfig(chunk_tokens=CHUNK)), kv_store=store)
        llm_a.generate([prompt], GREEDY)
        assert llm_a.flush_saves()
        llm_a.close()
        llm_b = LLM(b, EngineConfig(**engine_cfg, connector=ConnectorConfig(chunk_tokens=CHUNK)), kv_store=store)
        out = llm_b.generate([prompt], GREEDY)[0]
        llm_b.close()
    assert out.metrics.num_loaded_tokens == 0  # it was: 2 chunks of the other model's KV loaded as hits
    assert out.output_token_ids == cold_b
