"""Prefill-decode disaggregation with real processes: a prefill engine and a decode engine,
each in a process of its own, on one daemon process. Greedy outputs equal a colocated run
token for token (real SmolLM2), and every fault (the producer killed mid-transfer, the
consumer first, a missing chunk, chunks of another model, a daemon restart between prefill
and decode) ends in the colocated output within the bound, with no pin or buffer left."""

import random
import threading
import time
from pathlib import Path

import pytest

from connector import ConnectorConfig, DaemonBackendConfig
from connector.config import TransferConfig
from connector.roles import TransferParams
from engine import LLM, EngineConfig, SamplingParams
from engine.assets import smollm2_gguf_path
from engine.pd import EngineSpec
from engine.router import EngineDied, EngineProcess, Request, Router
from engine.testing import make_tiny_checkpoint
from kv_daemon import start_daemon
from kvstore.client import Client
from kvstore.daemon.spawn import DaemonProcess
from kvstore.keys import Namespace, chunk_keys
from real_models import smollm2

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
CHUNK = 32
WAIT_S = 2.0
PROSE = (Path(__file__).parents[2] / "bench" / "data" / "probe_prose.txt").read_text()


def connector(proc, role, **kw) -> ConnectorConfig:
    backend = DaemonBackendConfig(addr=proc.addr, token_file=proc.token_file, timeout_s=1.0)
    return ConnectorConfig(backend="daemon", daemon=backend, chunk_tokens=CHUNK, role=role,
                           transfer=TransferConfig(wait_s=WAIT_S), unavailable_backoff_s=1.0, **kw)


def spawn(model, proc, role, block_size=4, **kw) -> EngineProcess:
    conn = connector(proc, {"prefill": "producer", "decode": "consumer"}[role], **kw)
    return EngineProcess(EngineSpec(str(model), EngineConfig(num_blocks=256, block_size=block_size, connector=conn),
                                    role))


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def assert_clean(*engines) -> None:
    """Idle, every engine's books balance: no request tracked, no pin, no staging buffer out."""
    for e in engines:
        check = e.ask("check")
        assert "error" not in check, check
        assert check == {"op": "check", "pending": 0, "running": 0, "staged": 0}


def daemon_pins(proc) -> int:
    with Client(proc.addr, token_file=proc.token_file) as c:
        return c.stats().pinned


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")
    llm = LLM(path, EngineConfig(num_blocks=256, block_size=4))
    yield path, llm
    llm.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with start_daemon(tmp_path_factory.mktemp("pd-daemon"), slot_bytes="1MiB", page_bytes=16 << 10) as proc:
        yield proc


@pytest.fixture(scope="module")
def pair(tiny, daemon):
    pre, dec = spawn(tiny[0], daemon, "prefill"), spawn(tiny[0], daemon, "decode")
    yield pre, dec
    pre.close()
    dec.close()


def colocated(llm, tokens, params=GREEDY):
    llm.reset_prefix_cache()
    return llm.generate(tokens, params)[0].output_token_ids


def test_disaggregated_greedy_output_equals_colocated_on_smollm2(tmp_path):
    """Real SmolLM2 in two engine processes over one daemon: the decode loads every promised
    chunk (the partial last one it computes itself) and its tokens equal a colocated run's."""
    model = smollm2_gguf_path()
    ref = smollm2(num_blocks=128)  # the weights this process already loaded, if any
    tokens = ref.tokenizer.encode(PROSE)
    prompts = [tokens[:150], tokens[200:450]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [o.output_token_ids for o in ref.generate(prompts, params)]
    ref.close()
    with start_daemon(tmp_path / "d", slot_bytes="4MiB", page_bytes=64 << 10) as proc:
        pre = spawn(model, proc, "prefill", block_size=16)
        dec = spawn(model, proc, "decode", block_size=16)
        try:
            out = Router(dec, pre).run([Request(f"s{i}", p, params) for i, p in enumerate(prompts)])
            assert [r.token_ids for r in out] == expected
            for r, p in zip(out, prompts):
                full = len(p) // CHUNK * CHUNK
                assert r.prefill.transfer.num_tokens == full and r.decode.loaded_tokens == full
                assert r.decode.prefilled_tokens == len(p) - full + 1  # the partial chunk and the first token
                assert not r.rerouted and not r.decode.wait_timed_out
            assert_clean(pre, dec)
        finally:
            pre.close()
            dec.close()
        assert daemon_pins(proc) == 0


@pytest.mark.parametrize("threads, start_timeout_s, why", [(-1, 60.0, "exited before it was ready"),
                                                            (1, 0.0, "did not get ready in 0.0 s")])
def test_an_engine_that_never_gets_ready_is_killed_and_leaves_nothing_running(tiny, monkeypatch, threads,
                                                                               start_timeout_s, why):
    """An engine process that dies while it starts (here: torch refuses its thread count), or
    is still starting at the bound: the start says why, with the engine's last words, and
    leaves no process and no thread behind; nothing is reported from a thread (a Ctrl-C
    while engines started used to print a waiting thread's traceback)."""
    from_threads = []
    monkeypatch.setattr(threading, "excepthook", from_threads.append)
    threads_before = set(threading.enumerate())
    spec = EngineSpec(str(tiny[0]), EngineConfig(num_blocks=16, block_size=4), "decode", threads=threads)
    with pytest.raises(EngineDied, match=why) as died:
        EngineProcess(spec, start_timeout_s=start_timeout_s)
    if threads < 0:
        assert "set_num_threads" in str(died.value)
    assert set(threading.enumerate()) <= threads_before and not from_threads


def test_raw_transfer_loads_every_promised_chunk_and_equals_colocated(tiny, pair, daemon):
    pre, dec = pair
    prompts = [prompt(1, 100), prompt(2, 64), prompt(3, 31)]  # partial, exact, no full chunk
    out = Router(dec, pre).run([Request(f"raw{i}", p, GREEDY) for i, p in enumerate(prompts)])
    for r, p in zip(out, prompts):
        assert r.token_ids == colocated(tiny[1], p)
        assert r.decode.loaded_tokens == len(p) // CHUNK * CHUNK == r.prefill.transfer.num_tokens
    assert_clean(pre, dec)
    assert daemon_pins(daemon) == 0


def test_a_request_an_engine_refuses_is_answered_and_the_engines_serve_on(tiny, pair):
    """A prompt longer than the model's context: refused by the prefill engine with one line,
    the router answers it, and the next request is served as colocated would."""
    pre, dec = pair
    out = Router(dec, pre).run([Request("long", prompt(9, 600), GREEDY), Request("ok", prompt(10, 40), GREEDY)])
    assert "context holds 512" in out[0].error and out[0].token_ids == []
    assert out[1].error is None and out[1].token_ids == colocated(tiny[1], prompt(10, 40))
    assert_clean(pre, dec)


def test_a_consumer_that_starts_first_waits_for_the_chunks_then_loads_them(tiny, pair, daemon):
    """The decode gets the promise (keys computed from the prompt) before the prefill runs;
    it waits, then loads every chunk once the producer's puts land, and computes the first token."""
    pre, dec = pair
    p = prompt(4, 128)
    ns = Namespace(tiny[1].model_id, 2, 2, 16, "float32", CHUNK)
    keys = chunk_keys(p, ns)
    started = time.monotonic()
    dec.submit("first", p, GREEDY, TransferParams("first", [k.id.hex() for k in keys], len(keys) * CHUNK).to_dict())
    time.sleep(0.5)
    pre.submit("first", p, GREEDY)
    assert pre.recv()["finished"].transfer.num_tokens == 128
    f = dec.recv()["finished"]
    assert f.token_ids == colocated(tiny[1], p)
    assert f.loaded_tokens == 128 and not f.wait_timed_out and 0.4 < f.wait_s < WAIT_S
    assert time.monotonic() - started < WAIT_S + 5
    assert_clean(pre, dec)


def test_a_missing_chunk_is_waited_for_within_the_bound_then_recomputed(tiny, pair, daemon):
    pre, dec = pair
    p = prompt(5, 160)
    pre.submit("miss", p, GREEDY)
    transfer = pre.recv()["finished"].transfer
    assert len(transfer.key_ids) == 5
    ns = Namespace(tiny[1].model_id, 2, 2, 16, "float32", CHUNK)
    with Client(daemon.addr, token_file=daemon.token_file) as c:
        assert c.delete([chunk_keys(p, ns)[2]]) == 1
    started = time.monotonic()
    dec.submit("miss", p, GREEDY, transfer.to_dict())
    f = dec.recv()["finished"]
    assert time.monotonic() - started < WAIT_S + 5
    assert f.wait_timed_out and f.wait_s >= WAIT_S
    assert f.loaded_tokens == 2 * CHUNK  # the chunks before the missing one
    assert f.token_ids == colocated(tiny[1], p)
    assert_clean(pre, dec)
    assert daemon_pins(daemon) == 0


def test_chunks_of_another_model_are_never_waited_for_nor_loaded(tiny, daemon, pair):
    """A producer of another model (its namespace) promises keys the consumer could never
    see: the consumer does not wait and computes the whole prompt."""
    other = spawn(tiny[0], daemon, "prefill", model_id="another-model")
    try:
        _, dec = pair
        p = prompt(6, 96)
        out = Router(dec, other).run([Request("other", p, GREEDY)])[0]
        assert len(out.prefill.transfer.key_ids) == 3
        assert out.token_ids == colocated(tiny[1], p)
        assert out.decode.loaded_tokens == 0 and not out.decode.wait_timed_out and out.decode.wait_s < 1.0
        assert_clean(other, dec)
    finally:
        other.close()


def throttled_daemon(root: Path, bytes_per_s: str) -> DaemonProcess:
    """A daemon whose disk (the durable tier) takes ``bytes_per_s``: durable puts are slow."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "token").write_text("pd-token\n")
    (root / "d.toml").write_text(f'[shm]\nslots = 16\nslot_bytes = "1MiB"\n[store.host]\ncapacity_bytes = "64MiB"\n'
                                 f'page_bytes = 16384\n[store.disk]\ncapacity_bytes = "256MiB"\n'
                                 f'read_bytes_per_s = "{bytes_per_s}"\n')
    proc = DaemonProcess(["--config", str(root / "d.toml"), "--listen", "127.0.0.1:0", "--data-dir",
                          str(root / "data"), "--auth-token-file", str(root / "token")])
    proc.token_file = str(root / "token")
    return proc


def test_a_producer_killed_mid_transfer_leaves_the_decode_to_compute_it(tiny, tmp_path):
    """Durable puts at 100 kB/s take about 0.16 s a chunk: the producer is killed once some
    chunks landed and before it could promise any. The router sends the request on without a
    transfer; the decode loads what did land and computes the rest."""
    with throttled_daemon(tmp_path / "slow", "100kB") as proc:
        pre, dec = spawn(tiny[0], proc, "prefill"), spawn(tiny[0], proc, "decode")
        try:
            p = prompt(7, 320)
            keys = chunk_keys(p, Namespace(tiny[1].model_id, 2, 2, 16, "float32", CHUNK))

            def kill_once_some_landed():
                with Client(proc.addr, token_file=proc.token_file) as c:
                    deadline = time.monotonic() + 30
                    while c.lookup(keys) < 2 and time.monotonic() < deadline:
                        time.sleep(0.01)
                pre.kill()

            killer = threading.Thread(target=kill_once_some_landed)
            killer.start()
            started = time.monotonic()
            out = Router(dec, pre, prefill_timeout_s=30).run([Request("killed", p, GREEDY)])[0]
            killer.join()
            assert out.rerouted and out.prefill is None
            assert out.token_ids == colocated(tiny[1], p)
            assert 2 * CHUNK <= out.decode.loaded_tokens < len(keys) * CHUNK
            assert time.monotonic() - started < 10  # the router saw the death: no prefill timeout
            assert_clean(dec)
        finally:
            pre.close()
            dec.close()


def test_a_daemon_restart_between_prefill_and_decode_still_ends_in_the_right_output(tiny, tmp_path):
    """The producer's puts were durable (on the daemon's disk): after a restart on the same data
    the decode's client reconnects, finds them, loads and decodes; nothing waits past the bound."""
    root = tmp_path / "restart"
    proc = start_daemon(root, slot_bytes="1MiB", page_bytes=16 << 10)
    pre, dec = spawn(tiny[0], proc, "prefill"), spawn(tiny[0], proc, "decode")
    try:
        p = prompt(8, 100)
        pre.submit("restart", p, GREEDY)
        transfer = pre.recv()["finished"].transfer
        assert transfer.num_tokens == 96
        addr = proc.addr
        assert proc.stop() == 0
        proc = start_daemon(root, slot_bytes="1MiB", page_bytes=16 << 10, listen=addr)
        started = time.monotonic()
        dec.submit("restart", p, GREEDY, transfer.to_dict())
        f = dec.recv()["finished"]
        assert time.monotonic() - started < WAIT_S + 5
        assert f.token_ids == colocated(tiny[1], p)
        assert f.loaded_tokens == 96 and not f.wait_timed_out  # the client reconnected; the disk kept them
        assert_clean(pre, dec)
    finally:
        pre.close()
        dec.close()
        proc.stop()
