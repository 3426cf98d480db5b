"""Agent-session events on a real daemon: Pause pins a session's chunks and remembers them,
ResumeSoon by session id alone brings them back to host RAM; both advisory (unknown, late
or absurd events are no-ops, never errors), leases always end, and a tenant never sees or
resumes another's sessions."""

import hashlib
import math
import time

import pytest
import torch

from kvstore.client import Client, DaemonError
from kvstore.daemon.spawn import DaemonProcess
from kvstore.keys import Namespace, chunk_keys

TOKENS = {"alice": "alice-secret", "bob": "bob-secret"}
SESSION_NS = Namespace("session-model", 2, 2, 32, chunk_tokens=32)  # 16 KiB fp16 chunks
MAX_PIN_S = 2.0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("sessions")
    tenants = "".join(f'[tenants.{n}]\ntoken_sha256 = "{hashlib.sha256(t.encode()).hexdigest()}"\n'
                      for n, t in TOKENS.items())
    (root / "tenants.toml").write_text(tenants)
    (root / "daemon.toml").write_text(f'[limits]\nmax_pin_ttl_s = {MAX_PIN_S}\n[store.host]\n'
                                      'capacity_bytes = "1MiB"\npage_bytes = 4096\n[store.disk]\n'
                                      'capacity_bytes = "64MiB"\n')
    with DaemonProcess(["--config", str(root / "daemon.toml"), "--listen", "127.0.0.1:0",
                        "--data-dir", str(root / "data"), "--tenants-file", str(root / "tenants.toml")]) as proc:
        yield proc


@pytest.fixture
def alice(daemon):
    with Client(daemon.addr, token=TOKENS["alice"]) as c:
        yield c


@pytest.fixture
def bob(daemon):
    with Client(daemon.addr, token=TOKENS["bob"]) as c:
        yield c


def history(client, seed: float):
    """A session's four chunks (their own tokens per seed), durable, so they outlive host RAM."""
    first = 500 + int(seed) * 1000
    keys = chunk_keys(list(range(first, first + 4 * 32)), SESSION_NS)
    values = [torch.full(SESSION_NS.chunk_shape, seed + i, dtype=torch.float16) for i in range(len(keys))]
    for k, v in zip(keys, values):
        client.put(k, v, durable=True)
    return keys, values


def push_out_of_host_ram(client):
    """Enough other chunks (unpinned) that the history's go down to the disk tier."""
    for i in range(3):
        for k in chunk_keys(list(range(10_000 * (i + 1), 10_000 * (i + 1) + 32 * 32)), SESSION_NS):
            client.put(k, torch.zeros(SESSION_NS.chunk_shape, dtype=torch.float16))


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_resume_soon_by_session_id_brings_a_paused_history_back_to_host_ram(alice):
    keys, values = history(alice, 1.0)
    push_out_of_host_ram(alice)
    host_hits = alice.stats().tiers["host"].hits
    assert alice.pause("agent-1", keys, expected_s=30.0) == len(keys)
    assert alice.resume_soon("agent-1", eta_s=1.0) == len(keys)  # one promotion per chunk on disk only
    wait_until(lambda: alice.prefetch(keys) == [])  # nothing left to promote: all in host RAM
    got = alice.get(keys)
    assert len(got) == len(keys) and all(torch.equal(a, b) for a, b in zip(got, values))
    assert alice.stats().tiers["host"].hits - host_hits == len(keys)
    wait_until(lambda: alice.stats().pinned == 0, timeout_s=3 * MAX_PIN_S)  # leases end, capped by the daemon


def test_a_tenant_can_neither_resume_nor_end_anothers_session(alice, bob):
    keys, _ = history(alice, 10.0)
    push_out_of_host_ram(alice)
    assert alice.pause("shared-name", keys, ttl_s=MAX_PIN_S) == len(keys)
    assert bob.pause("shared-name", keys, ttl_s=MAX_PIN_S) == 0  # bob's keys name bob's own chunks: none
    assert bob.resume_soon("shared-name", eta_s=1.0) == 0  # bob's record of the name: nothing of alice's
    assert alice.resume_soon("shared-name", eta_s=1.0) == len(keys)  # alice's, untouched


@pytest.mark.parametrize("expected, ttl", [(None, None), (-1.0, -5.0), (math.nan, math.inf), (1e12, 1e12),
                                           (0.0, 0.0)])
def test_absurd_durations_are_no_errors_and_leases_still_end(alice, expected, ttl):
    keys, _ = history(alice, 20.0)
    assert alice.pause("odd", keys, expected_s=expected, ttl_s=ttl) == len(keys)
    assert alice.resume_soon("odd", eta_s=ttl if ttl is not None else 0.0) >= 0
    wait_until(lambda: alice.stats().pinned == 0, timeout_s=3 * MAX_PIN_S)
    wait_until(lambda: alice.resume_soon("odd") == 0, timeout_s=3 * MAX_PIN_S)  # forgotten with its lease


def test_unknown_sessions_are_no_ops_and_a_missing_id_is_refused(alice):
    assert alice.resume_soon("never-paused", eta_s=5.0) == 0
    assert alice.pause("no-keys", []) == 0
    with pytest.raises(DaemonError) as info:
        alice.resume_soon("")
    assert info.value.code.name == "INVALID_ARGUMENT"
    with pytest.raises(DaemonError):
        alice.pause("x" * 300, chunk_keys(list(range(32)), SESSION_NS))
