"""The daemon's configuration was checked for unknown keys and types only;
values no daemon can serve with were taken, and failed later: every shared-memory Put with a lease
TTL of 0, every request with a request limit of 0, every bulk request with a frame timeout of
0, and a bulk port out of range ends the start with a traceback and exit code 1 (which the
systemd unit restarts forever) instead of the documented one line and exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("table,line,key", [
    ("shm", "lease_ttl_s = 0", "shm.lease_ttl_s"),
    ("shm", "max_slots_per_lease = 0", "shm.max_slots_per_lease"),
    ("limits", "max_requests_per_tenant = 0", "limits.max_requests_per_tenant"),
    ("limits", "max_chunk_bytes = 0", "limits.max_chunk_bytes"),
    ("limits", "max_concurrent_streams = 0", "limits.max_concurrent_streams"),
    ("limits", "scheduler_half_life_s = 0", "limits.scheduler_half_life_s"),
    ("limits", "scheduler_max_wait_s = -1", "limits.scheduler_max_wait_s"),
    ("bulk", "frame_timeout_s = 0", "bulk.frame_timeout_s"),
    ("bulk", "port = 70000", "bulk.port"),
    (None, "flush_timeout_s = -1", "flush_timeout_s"),
])
def test_a_value_no_daemon_can_serve_with_is_refused_naming_its_key(tmp_path, table, line, key):
    config = tmp_path / "daemon.toml"
    config.write_text(f"[{table}]\n{line}\n" if table else f"{line}\n")
    proc = run("config", "--daemon", "--config", str(config), cwd=tmp_path)
    assert proc.returncode == 2, f"`{line}` in [{table}] accepted: exit {proc.returncode}"
    assert key in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_serve_with_a_bulk_port_out_of_range_is_one_line_and_exit_code_2(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    config = tmp_path / "daemon.toml"
    config.write_text(f'[bulk]\nport = 70000\n[shm]\ndir = "{shm}"\n[store.host]\ncapacity_bytes = "8MiB"\n'
                      'prefault = false\n')
    proc = run("serve", "--config", str(config), "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"),
               cwd=tmp_path)
    assert "Traceback" not in proc.stderr, proc.stderr[-1500:]
    assert proc.returncode == 2 and "bulk.port" in proc.stderr, (proc.returncode, proc.stderr[-1500:])
    assert os.listdir(shm) == []


def test_every_size_setting_takes_a_size_with_a_unit(tmp_path):
    """Finding 8 of issue 36: sizes were parsed only for names ending in ``_bytes``, so the
    documented ``max_bytes_in_flight_per_tenant = "1GiB"`` was refused at start."""
    config = tmp_path / "daemon.toml"
    config.write_text('[limits]\nmax_bytes_in_flight_per_tenant = "3GiB"\n')
    proc = run("config", "--daemon", "--config", str(config), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"max_bytes_in_flight_per_tenant = {3 << 30}" in proc.stdout


def test_the_documented_daemon_configuration_loads(tmp_path):
    """docs/daemon.md's configuration example is a file `kvstore serve --config` takes: it
    said ``max_bytes_in_flight_per_tenant = "1GiB"``, which was refused (finding 8 of issue 36)."""
    text = (ROOT / "docs" / "daemon.md").read_text()
    example = text.split("### Configuration", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    config = tmp_path / "daemon.toml"
    config.write_text(example)
    proc = run("config", "--daemon", "--config", str(config), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"max_bytes_in_flight_per_tenant = {1 << 30}" in proc.stdout
    assert f"max_receive_bytes = {1 << 30}" in proc.stdout
