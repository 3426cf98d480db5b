"""Dispatch: CPU tensors take the torch references, and the package works without triton."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kernels._triton as backend
from kernels import block_copy, cache_write, paged_attention, quant

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def triton_forbidden(monkeypatch):
    """Every ``*_triton`` op raises, so passing tests prove the torch path was taken."""
    def boom(*args, **kwargs):
        raise AssertionError("Triton path taken for CPU tensors")

    ops = {
        paged_attention: ["paged_decode_attention"],
        cache_write: ["reshape_and_cache"],
        block_copy: ["gather_blocks", "scatter_blocks", "gather_layer_blocks", "scatter_layer_blocks"],
        quant: ["quantize_int8", "dequantize_int8", "quantize_int4", "dequantize_int4"],
    }
    for module, names in ops.items():
        for name in names:
            monkeypatch.setattr(module, f"{name}_triton", boom)


def test_cpu_tensors_use_the_torch_references(triton_forbidden):
    query = torch.randn(1, 3, 8)
    k_cache = torch.randn(2, 4, 1, 8)
    tables = torch.tensor([[1, 0]], dtype=torch.int32)
    lens = torch.tensor([6], dtype=torch.int32)
    out = paged_attention.paged_decode_attention(query, k_cache, k_cache, tables, lens, 0.5)
    assert torch.equal(out, paged_attention.paged_decode_attention_torch(query, k_cache, k_cache, tables, lens, 0.5))

    cache_write.reshape_and_cache(query[:, :1], query[:, :1], k_cache, k_cache.clone(), torch.tensor([5]))
    assert torch.equal(k_cache[1, 1], query[0, :1])

    kv = torch.randn(2, 2, 3, 4, 1, 8)
    chunk = block_copy.gather_blocks(kv, torch.tensor([2]))
    block_copy.scatter_blocks(chunk, kv, torch.tensor([0]))
    assert torch.equal(kv[:, :, 0], kv[:, :, 2])
    layer = block_copy.gather_layer_blocks(kv[1], torch.tensor([1]))
    block_copy.scatter_layer_blocks(layer, kv[1], torch.tensor([0]))
    assert torch.equal(kv[1, :, 0], kv[1, :, 1])

    q, scale = quant.quantize_int8(query)
    assert quant.dequantize_int8(q, scale, torch.float32).shape == query.shape
    packed, scale, zero = quant.quantize_int4(query, 8)
    assert quant.dequantize_int4(packed, scale, zero, 8, torch.float32).shape == query.shape


def test_use_triton_needs_triton_and_all_tensors_on_cuda(monkeypatch):
    cuda, cpu = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)
    if backend.triton is not None:
        assert backend.use_triton(cuda, cuda)
    assert not backend.use_triton(cuda, cpu)
    monkeypatch.setattr(backend, "triton", None)
    assert not backend.use_triton(cuda, cuda)
    with pytest.raises(RuntimeError, match="triton is not loaded"):
        quant.quantize_int8_triton(torch.zeros(1, 4))


def test_package_imports_and_runs_without_triton():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import torch
        from kernels import block_copy, cache_write, paged_attention, quant
        q = torch.randn(1, 2, 8)
        k = torch.randn(1, 4, 1, 8)
        paged_attention.paged_decode_attention(q, k, k, torch.tensor([[0]]), torch.tensor([3]), 1.0)
        quant.quantize_int4(q, 8)
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a CUDA device triton is loaded")
def test_a_cpu_process_does_not_load_triton_unless_it_interprets_kernels():
    """No kernel can run on a CPU: loading triton there only cost every process, the daemon
    included, ~73 MB of memory and ~70 ms (kernels/_triton.py)."""
    script = textwrap.dedent(
        """
        import sys
        import torch
        import kvstore.daemon.server
        from kernels import quant
        quant.quantize_int8(torch.randn(2, 8))
        print("triton loaded" if "triton" in sys.modules else "no triton")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for extra, expected in (({}, "no triton"), ({"TRITON_INTERPRET": "1"}, "triton loaded")):
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                                cwd=ROOT, env={**env, **extra})
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == expected
