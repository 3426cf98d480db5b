"""The engine with the connector over a real daemon process: loads over shared memory and
over the remote path give the outputs of a store-less run on the real SmolLM2; an engine
process that talks to a daemon never imports the Store, its tiers or its policies; a daemon
that stalls, dies or restarts leaves outputs identical, with one log line per outage."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from connector import ConnectorConfig, DaemonBackendConfig
from engine import LLM, EngineConfig, SamplingParams
from engine.testing import make_tiny_checkpoint
import real_models
from kv_daemon import start_daemon

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
PROSE = (Path(__file__).parents[2] / "bench" / "data" / "probe_prose.txt").read_text()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def smollm2():
    return real_models.smollm2(num_blocks=64)  # the weights this process already loaded, if any


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")
    return LLM(path, EngineConfig(num_blocks=64, block_size=4))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with start_daemon(tmp_path_factory.mktemp("connector-daemon"), slot_bytes="2MiB", page_bytes=64 << 10) as proc:
        yield proc


def daemon_engine(base, proc, transport="auto", chunk=32, **connector):
    backend = DaemonBackendConfig(addr=proc.addr, transport=transport, token_file=proc.token_file, timeout_s=2.0)
    return base.with_config(connector=ConnectorConfig(backend="daemon", daemon=backend, chunk_tokens=chunk,
                                                      **connector))


def run(llm, prompts):
    seqs = [llm.add_request(p, GREEDY) for p in prompts]
    while llm.has_unfinished():
        llm.step()
        llm.scheduler.check_integrity()
    return [s.output_token_ids for s in seqs], seqs


@pytest.mark.parametrize("transport, path", [("shm", "shm"), ("remote", "bulk")])
def test_loads_through_a_daemon_give_the_outputs_of_a_store_less_run(smollm2, daemon, transport, path):
    tokens = smollm2.tokenizer.encode(PROSE)
    start = 300 if transport == "shm" else 600  # the daemon is shared: each case its own prompts
    prompts = [tokens[start:start + 96], tokens[start + 100:start + 171]]
    want = run(smollm2.with_config(), prompts)[0]
    with daemon_engine(smollm2, daemon, transport) as cold:
        assert cold.kv_store.path == path
        assert run(cold, prompts)[0] == want
        assert cold.flush_saves()
    with daemon_engine(smollm2, daemon, transport) as warm:
        got, seqs = run(warm, prompts)
        assert got == want
        assert [s.metrics.num_loaded_tokens for s in seqs] == [96, 64]
        assert [s.metrics.num_prefilled_tokens for s in seqs] == [1, 7]
        assert warm.kv_store.stats().pinned == 0


ISOLATED = textwrap.dedent("""
    import json, sys
    from connector import ConnectorConfig, DaemonBackendConfig
    from engine import LLM, EngineConfig, SamplingParams
    model, addr, token_file = sys.argv[1:4]
    backend = DaemonBackendConfig(addr=addr, token_file=token_file)
    config = EngineConfig(num_blocks=64, block_size=4,
                          connector=ConnectorConfig(backend="daemon", daemon=backend, chunk_tokens=16))
    with LLM(model, config) as cold:
        cold.generate(list(range(5, 60)), SamplingParams(max_tokens=3, temperature=0))
        cold.flush_saves()
        with cold.with_config() as warm:  # an empty local prefix cache: the chunks come from the daemon
            (out,) = warm.generate(list(range(5, 60)), SamplingParams(max_tokens=3, temperature=0))
    heavy = sorted(m for m in sys.modules if m == "kvstore.store" or m.startswith(
        ("tiers", "kvstore.policies", "kvstore.daemon", "kvstore.store.placement", "kvstore.store.tier_setup")))
    print(json.dumps({"heavy": heavy, "loaded": out.metrics.num_loaded_tokens}))
""")


def test_an_engine_on_a_daemon_never_imports_the_store_its_tiers_or_policies(daemon, tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=5)
    result = subprocess.run([sys.executable, "-c", ISOLATED, str(checkpoint), daemon.addr, daemon.token_file],
                            capture_output=True, text=True, timeout=300, cwd=str(Path(__file__).parents[2]))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report == {"heavy": [], "loaded": 52}  # 3 chunks of 16 and a tail of one 4-token block


def wait_until(condition, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_a_stalled_then_restarted_daemon_leaves_outputs_identical(tiny, tmp_path, caplog):
    """Stopped (SIGSTOP), every call times out: the connector goes off with one log line and
    the engine recomputes. Then the daemon restarts on the same data: after the back-off the
    connector finds the chunks again (on the disk tier) and loads them."""
    prompts = [list(range(5, 5 + 16 * 3 + 3)), list(range(70, 70 + 40))]
    want = run(tiny.with_config(), prompts)[0]
    root = tmp_path / "daemon"
    proc = start_daemon(root)
    try:
        with daemon_engine(tiny, proc, chunk=16) as cold:
            assert run(cold, prompts)[0] == want
            assert cold.flush_saves()
        os.kill(proc.proc.pid, signal.SIGSTOP)
        try:
            with caplog.at_level(logging.WARNING, logger="connector"), \
                    daemon_engine(tiny, proc, chunk=16, unavailable_backoff_s=0.5) as llm:
                got, seqs = run(llm, prompts)
                assert got == want
                assert sum(s.metrics.num_loaded_tokens for s in seqs) == 0
                lines = [r.getMessage() for r in caplog.records if r.name == "connector"]
                assert len(lines) == 1 and "store unavailable" in lines[0]
        finally:
            os.kill(proc.proc.pid, signal.SIGCONT)
        addr = proc.addr
        proc.stop()
        proc = start_daemon(root, listen=addr)
        with daemon_engine(tiny, proc, chunk=16) as llm:
            got, seqs = run(llm, prompts)
            assert got == want
            assert [s.metrics.num_loaded_tokens for s in seqs] == [48, 40]  # 3 chunks; 2 chunks and a tail
    finally:
        proc.stop()


def test_a_daemon_that_dies_while_the_engine_runs_leaves_outputs_identical(tiny, tmp_path, caplog):
    prompts = [list(range(9, 9 + 16 * 2 + 5)), list(range(90, 90 + 37))]
    want = run(tiny.with_config(), prompts)[0]
    proc = start_daemon(tmp_path / "daemon")
    with caplog.at_level(logging.WARNING, logger="connector"), daemon_engine(tiny, proc, chunk=16) as llm:
        first = llm.add_request(prompts[0], GREEDY)
        llm.step()
        proc.stop()  # gone while the first request decodes and saves
        second = llm.add_request(prompts[1], GREEDY)
        while llm.has_unfinished():
            llm.step()
            llm.scheduler.check_integrity()
        assert [first.output_token_ids, second.output_token_ids] == want
        wait_until(lambda: llm.flush_saves(1.0))
        assert llm.stats().connector.outages == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "connector"]
    assert len(lines) == 1 and "store unavailable" in lines[0]
