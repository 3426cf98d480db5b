"""The GPU check script's logic that needs no GPU: peak bandwidth, byte counts, the table,
the no-CUDA exit, and its correctness sweep run under the interpreter on a tiny model."""

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_check"]


def test_peak_from_device_properties_and_flag(gpu_check):
    # an H100 SXM reports a 2619 MHz memory clock on a 5120-bit bus: about 3352 GB/s
    props = SimpleNamespace(memory_clock_rate=2_619_000, memory_bus_width=5120)
    peak, source = gpu_check.peak_gbps(props)
    assert peak == pytest.approx(3352.32) and "device" in source
    assert gpu_check.peak_gbps(props, 4800.0) == (4800.0, "--peak-gbps")
    assert gpu_check.peak_gbps(SimpleNamespace())[0] is None


def test_kv_bytes_count_k_and_v_of_every_token(gpu_check):
    # SmolLM2 layer: 3 kv heads x 64 dims x fp16, K and V: 768 bytes per token
    assert gpu_check.kv_bytes_read([100, 28], kv_heads=3, head_dim=64, itemsize=2) == 128 * 768


def test_format_table(gpu_check):
    table = gpu_check.format_table([{"op": "gather", "err": 0.0}, {"op": "paged_decode_attention", "err": 1.5e-3}])
    lines = table.splitlines()
    assert lines[0].split() == ["op", "err"] and len({len(line) for line in lines}) == 1
    assert "0.0015" in lines[3]


def test_exits_2_with_a_message_without_cuda(gpu_check, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would really run")
    out = tmp_path / "r.json"
    assert gpu_check.main([str(out)]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
    assert not out.exists()


def test_correctness_sweep_passes_on_a_tiny_model(gpu_check):
    pytest.importorskip("triton")
    tiny = gpu_check.ModelShape("tiny", layers=1, q_heads=3, kv_heads=1, head_dim=32, block_size=16)
    checks = gpu_check.check_shape(tiny, torch.float16, torch.device("cpu"), contexts=(1, 17, 90))
    assert {c.op for c in checks} >= {"paged_decode_attention", "gather_blocks", "scatter_blocks", "quantize_int4"}
    failed = {c.op for c in checks if not c.ok}
    assert failed == {"dispatch_picks_triton"}  # CPU tensors: the dispatchers rightly pick torch


def test_connector_check_runs_on_a_cpu(gpu_check, tmp_path):
    """The script's connector part, on CPU tensors: outputs with the store equal those without."""
    checks, figures = gpu_check.check_connector(torch.device("cpu"), tmp_path)
    assert [c.ok for c in checks] == [True] * 4
    assert all(f["loaded_tokens"] > 0 for k, f in figures.items() if isinstance(f, dict))
    assert figures["kvikio_used"] is False


def test_chunk_load_measurement_runs_on_a_cpu(gpu_check):
    """The script's load figures, on CPU tensors: every path loads every chunk it times."""
    tiny = gpu_check.ModelShape("tiny", layers=2, q_heads=2, kv_heads=1, head_dim=8, block_size=16)
    rates = gpu_check.measure_chunk_loads(torch.device("cpu"), tiny, chunk_tokens=32, chunks=6, threads=(1, 2),
                                          rounds=1)
    assert [(r.path.split()[:2], r.threads) for r in rates] == [
        (["pinned", "host"], 1), (["get_into", "pinned"], 1), (["get_into", "pinned"], 2),
        (["borrow", "registered"], 1), (["borrow", "registered"], 2)]
    assert all(r.gbps > 0 and r.chunk_bytes == 2 * 2 * 32 * 8 * 2 for r in rates)


def test_daemon_load_measurement_runs_on_a_cpu(gpu_check, tmp_path):
    """The script's daemon figures, on CPU tensors against a real daemon: staged and handed
    over with each read size, every chunk loads, and the loaded bytes equal the daemon's."""
    tiny = gpu_check.ModelShape("tiny", layers=2, q_heads=2, kv_heads=1, head_dim=8, block_size=16)
    rates = gpu_check.measure_daemon_loads(torch.device("cpu"), tmp_path, tiny, chunk_tokens=32, chunks=6,
                                           load_workers=2, rounds=1, chunks_per_read=(2, 4))
    assert [r.path.split(":")[0] for r in rates] == ["pinned host -> device copy (limit)", "daemon", "daemon", "daemon"]
    assert [r.path.split(", ")[-1] for r in rates[2:]] == ["2 chunks a read", "4 chunks a read"]
    assert all(r.gbps > 0 for r in rates)
