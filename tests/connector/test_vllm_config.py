"""The connector's configuration and namespace as vLLM's config gives them (no engine start:
one process under the vLLM venv builds VllmConfigs and reports): a different dtype or block size
is another namespace, and mistakes are one-line errors at start."""

from __future__ import annotations

import json
import subprocess

import pytest

from connector.vllm_process import ROOT, SKIP_REASON, VLLM_PYTHON

pytestmark = [pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=SKIP_REASON), pytest.mark.timeout(600)]

SCRIPT = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
from kvstore.config import ConfigError
from connector.vllm import connector_config, vllm_namespace

model = sys.argv[1]
def config(dtype="float32", block_size=128, **extra):
    kv = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "connector.vllm", "kv_role": "kv_both",
          "kv_connector_extra_config": extra}
    return EngineArgs(model=model, dtype=dtype, block_size=block_size, max_model_len=2048,
                      kv_transfer_config=kv).create_engine_config()

def namespace(**kw):
    c = config(**kw)
    return repr(vllm_namespace(c, connector_config(c)))

def error(**kw):
    try:
        connector_config(config(**kw))
    except ConfigError as exc:
        return str(exc)
    return None

print(json.dumps({
    "fp32": namespace(), "fp32_again": namespace(), "bf16": namespace(dtype="bfloat16"),
    "block_256": namespace(block_size=256),
    "chunk_not_whole_blocks": error(chunk_tokens=192),
    "in_process_store": error(backend="store"),
    "unknown_key": error(chunk_tokenz=256),
}))
"""


@pytest.fixture(scope="module")
def report():
    from engine.hf_folder import smollm2_hf_path

    out = subprocess.run([str(VLLM_PYTHON), "-c", SCRIPT, str(smollm2_hf_path())], capture_output=True, text=True,
                         cwd=ROOT, timeout=500)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_namespace_is_the_same_in_every_process_and_differs_by_dtype_and_block_size(report):
    assert report["fp32"] == report["fp32_again"]
    assert len({report["fp32"], report["bf16"], report["block_256"]}) == 3


def test_a_chunk_that_is_not_whole_blocks_is_refused_at_start(report):
    assert "chunk_tokens 192 is not a multiple" in report["chunk_not_whole_blocks"]


def test_an_in_process_store_is_refused_since_vllm_runs_two_processes(report):
    assert "must be 'daemon'" in report["in_process_store"]


def test_an_unknown_key_is_refused(report):
    assert report["unknown_key"] is not None and "chunk_tokenz" in report["unknown_key"]
