"""Agent sessions on an engine whose store is a real daemon process: the daemon restarting
during a stall costs the session its pins (and maybe a recompute), never an error or a wrong
token; a later pause on the restarted daemon pins again."""

import time

import pytest

from connector import ConnectorConfig, DaemonBackendConfig
from engine import LLM, EngineConfig, SamplingParams
from engine.agent_config import AgentConfig
from engine.testing import make_tiny_checkpoint
from kv_daemon import start_daemon
from kvstore.client import Client, DaemonError

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")
    return LLM(path, EngineConfig(num_blocks=40, block_size=4))


def pinned(proc) -> int:
    with Client(proc.addr, token_file=proc.token_file) as client:
        return client.stats().pinned


def wait_until_reachable(client, timeout_s=15.0):
    """The engine's own channel reconnects with gRPC's back-off: wait for it, not a fixed time."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.stats()
            return
        except DaemonError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def turn(llm, prompt, session):
    seq = llm.add_request(prompt, GREEDY, session=session)
    while llm.has_unfinished():
        llm.step()
        llm.scheduler.check_integrity()
    return seq


def test_a_daemon_restart_during_a_stall_means_at_most_a_recompute(tiny, tmp_path):
    root = tmp_path / "daemon"
    proc = start_daemon(root)
    backend = DaemonBackendConfig(addr=proc.addr, token_file=proc.token_file, timeout_s=2.0)
    llm = tiny.with_config(connector=ConnectorConfig(backend="daemon", daemon=backend, chunk_tokens=16,
                                                     unavailable_backoff_s=0.2), agents=AgentConfig(policy="offload"))
    try:
        prompt = list(range(5, 5 + 2 * 16 + 4 + 1))  # with 4 of 5 outputs: two chunks and a 2-block tail
        first = turn(llm, prompt, "a")
        assert llm.pause("a", expected_s=30.0)
        assert llm.flush_saves()
        llm.step()
        assert pinned(proc) == 3
        addr = proc.addr
        proc.stop()  # the daemon goes away mid-stall, pins and all
        assert llm.resume_soon("a", 0.5) is True  # an outage for the connector, not an error for the caller
        proc = start_daemon(root, listen=addr)
        wait_until_reachable(llm.kv_store)
        time.sleep(0.3)  # past the connector's back-off
        nxt = list(first.token_ids) + list(range(200, 207))
        for i in range(3):  # clear the local prefix cache: other requests take every block
            turn(llm, list(range(60 + 40 * i, 60 + 40 * i + 120)), "")
        want = tiny.with_config().generate([nxt], GREEDY)[0].output_token_ids
        second = turn(llm, nxt, "a")
        assert second.output_token_ids == want
        assert llm.pause("a", expected_s=30.0)  # on the restarted daemon: pinned again
        assert llm.flush_saves()
        llm.step()
        assert pinned(proc) > 0
        assert llm.end_session("a")
        assert pinned(proc) == 0
    finally:
        llm.close()
        proc.stop()


def test_the_daemon_learns_a_paused_session_so_the_framework_can_resume_it_by_id(tiny, tmp_path):
    """An engine on a daemon pauses through the daemon's Pause, so the agent framework, which
    knows when the agent comes back but no key, stretches the session's pins by its id alone."""
    proc = start_daemon(tmp_path / "daemon")
    backend = DaemonBackendConfig(addr=proc.addr, token_file=proc.token_file, timeout_s=2.0)
    llm = tiny.with_config(connector=ConnectorConfig(backend="daemon", daemon=backend, chunk_tokens=16),
                           agents=AgentConfig(policy="offload", min_pin_s=1.0, max_pin_s=1.0))
    try:
        turn(llm, list(range(5, 5 + 2 * 16 + 4 + 1)), "a")
        assert llm.pause("a", expected_s=30.0)  # the engine's lease: 1 s
        assert llm.flush_saves()
        llm.step()
        paused_at = time.monotonic()
        assert pinned(proc) == 3
        with Client(proc.addr, token_file=proc.token_file) as framework:
            assert framework.resume_soon("unknown", eta_s=20.0) == 0
            framework.resume_soon("a", eta_s=20.0)  # the daemon's lease: 4 x 20 s
        time.sleep(max(0.0, paused_at + 1.5 - time.monotonic()))  # past the engine's own lease
        assert pinned(proc) == 3
    finally:
        llm.close()
        proc.stop()


def test_a_resumed_turn_that_loads_one_chunk_and_the_session_tail_in_one_read(tiny, tmp_path):
    """A session's tail is a namespace of its own, and one read of the daemon's Client names
    one namespace. With two chunks a read, a turn whose load was one full chunk and the tail
    went out as one read, which raised ValueError out of the engine's step."""
    chunk, block = 16, 4
    proc = start_daemon(tmp_path / "daemon")
    backend = DaemonBackendConfig(addr=proc.addr, token_file=proc.token_file, timeout_s=5.0)
    llm = tiny.with_config(connector=ConnectorConfig(backend="daemon", daemon=backend, chunk_tokens=chunk,
                                                     chunks_per_read=2),
                           agents=AgentConfig(policy="offload"))
    try:
        prompt = list(range(5, 5 + chunk + 2 * block + 1))  # with 4 of 5 outputs: one chunk and a 3-block tail
        first = llm.add_request(prompt, GREEDY, session="a")
        while llm.has_unfinished():
            llm.step()
        assert llm.pause("a", expected_s=30.0)
        assert llm.flush_saves()
        llm.step()
        tail = llm.connector.scheduler.tails.get("a")
        assert tail is not None and tail.chunk == 1 and tail.num_blocks == 3
        llm.reset_prefix_cache()  # the next turn must come from the store: one chunk, then the tail
        nxt = list(first.token_ids) + list(range(200, 207))
        want = tiny.with_config().generate([nxt], GREEDY)[0].output_token_ids
        second = llm.add_request(nxt, GREEDY, session="a")
        while llm.has_unfinished():
            llm.step()
            llm.scheduler.check_integrity()
        assert second.output_token_ids == want
        assert second.metrics.num_loaded_tokens == chunk + 3 * block
    finally:
        llm.close()
        proc.stop()
