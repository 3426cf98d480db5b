"""The attacks of ``kvbench attack``, bounded to a few seconds each: a fuzzer on every RPC and
the bulk port, a connection flood, clients SIGKILLed mid-operation, kill -9 of the daemon
during durable put storms, a tenant against another's keys, a short soak. The long runs
(10,000 messages, 10 minutes of soak) are ``kvbench attack`` itself."""

import json
import shutil

import pytest

from bench.attacks import dying, fairness, flood, fuzz, kill9, soak, tenants
from bench.attacks.target import start
from bench.cli import main as kvbench
from kvstore.keys import chunk_keys


@pytest.fixture
def target(tmp_path):
    t = start(str(tmp_path), victims=16, max_open_files=512)
    yield t
    t.process.stop()
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_fuzzed_messages_get_deliberate_answers_and_harm_nothing(target):
    report = fuzz.run(target, 400, seed=7)
    assert report.sent >= 400 and not report.bugs, report.bugs
    assert report.statuses["INVALID_ARGUMENT"] > 0 and report.bulk_closed > 0
    assert target.serving() and report.victim_bad == 0


def test_a_connection_flood_is_shed_and_the_daemon_serves_on(target):
    report = flood.run(target, 300, 1.0)
    assert report.connections > 0 and report.legit_ops > 0 and report.wrong == 0
    assert report.new_client_ok and report.fds_after <= report.fds_before + 8
    assert target.intact() == 0


def test_clients_killed_mid_operation_give_everything_back(target):
    report = dying.run(target, rounds=1, seed=3, cases=(("get", "shm"), ("put", "remote"), ("pin", "shm")))
    assert sum(report.kills.values()) == 3 and report.wrong == 0 and report.victim_bad == 0


def test_a_tenant_gets_nothing_of_anothers_on_any_rpc_or_path(target):
    report = tenants.run(target)
    assert report.attempts >= 100 and not report.leaks and report.victim_bad == 0


def test_a_short_soak_reads_no_wrong_byte(target):
    report = soak.run(target, 3.0, workers=2)
    assert report.ops > 100 and report.hits > 0 and report.wrong == 0 and report.errors == 0
    assert report.victim_bad == 0


@pytest.fixture(scope="module")
def kill9_rounds(tmp_path_factory):
    return kill9.run(str(tmp_path_factory.mktemp("kill9")), rounds=2, acks_per_round=60, per_round=200)


def test_kill_9_during_durable_put_storms_loses_no_acknowledged_durable_chunk(kill9_rounds):
    assert kill9_rounds.rounds == 2 and kill9_rounds.acked_durable > 0 and kill9_rounds.lost == []


def test_kill_9_keeps_durable_re_puts_with_another_codec(kill9_rounds):
    assert kill9_rounds.acked_reputs > 0 and kill9_rounds.lost_reputs == []


def test_kvbench_attack_writes_its_reports(tmp_path, capsys):
    out = tmp_path / "attack.json"
    assert kvbench(["attack", "--mode", "tenants", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["tenants"]["leaks"] == []
    assert "tenants  ok" in capsys.readouterr().out


def test_a_well_behaved_tenant_is_served_beside_every_abusive_pattern(tmp_path):
    """Issue 36: beside each abusive pattern of another tenant, the well-behaved tenant sees
    no refusal, the health check answers throughout, and the abuser's excess is refused.
    (Its latency figures are the benchmark's: `kvbench attack --mode fairness`.)"""
    target = start(str(tmp_path), victims=8, extra=fairness.LIMITS, tenant_extra=fairness.TENANT_EXTRA)
    try:
        report = fairness.run(target, 1.0)
    finally:
        target.process.stop()
    assert report["victim_bad"] == 0
    for pattern, phase in report.items():
        if isinstance(phase, dict):
            assert phase["victim_refused"] == 0 and phase["health_failed"] == 0, (pattern, phase)
    for pattern in ("idle_streams", "withheld_frames", "one_byte_pieces"):
        assert report[pattern]["attacker_refused"] > 0, (pattern, report[pattern])


def test_a_control_run_aims_the_attacker_at_the_other_daemon(tmp_path):
    """`--control`: each pattern runs once more with its attacker on a second daemon while the
    victim measures the first, so the slowdown the machine alone causes is measured apart."""
    (tmp_path / "control").mkdir()
    target = start(str(tmp_path), victims=2, extra=fairness.LIMITS, tenant_extra=fairness.TENANT_EXTRA)
    control = start(str(tmp_path / "control"), victims=0, extra=fairness.LIMITS, tenant_extra=fairness.TENANT_EXTRA)
    try:
        before = [_tiny_chunks(t) for t in (target, control)]
        phase = fairness._phase(target, 1.0, "tiny_pinned", control)
        after = [_tiny_chunks(t) for t in (target, control)]
    finally:
        target.process.stop()
        control.process.stop()
    assert before == [0, 0] and after[0] == 0 and after[1] > 0, (before, after)
    assert phase.put_ms and phase.attacker_served > 0


def _tiny_chunks(target) -> int:
    """How many of the tiny-pinned attacker's first chunks ``target`` holds, in order."""
    with target.client("attacker") as client:
        return client.lookup(chunk_keys(list(range(64 * 8)), fairness.TINY))
