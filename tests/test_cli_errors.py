"""Every mistake a newcomer makes with the real ``kvstore`` and ``kvbench`` commands (run as
subprocesses): exit code 2, one line on stderr, no traceback, nothing left in /dev/shm."""

from __future__ import annotations

import fcntl
import gzip
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.daemon.shmfiles import PREFIXES

ROOT = Path(__file__).resolve().parents[1]
SHM = "/dev/shm"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens here once the socket is closed


def _orphans(before: set[str]) -> list[str]:
    """Our /dev/shm files created since ``before`` that no live process holds (left behind)."""
    left = []
    for name in set(os.listdir(SHM)) - before:
        if not name.startswith(PREFIXES):
            continue
        try:
            fd = os.open(os.path.join(SHM, name), os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            left.append(name)  # nobody holds it: an orphan
        except OSError:
            pass  # another live daemon's file
        finally:
            os.close(fd)
    return left


def run_cli(tool: str, *argv: str, cwd: Path) -> str:
    """Run ``tool`` (kvstore or kvbench), check it failed as a user error should, return stderr."""
    module = {"kvstore": "kvstore", "kvbench": "bench"}[tool]
    before = set(os.listdir(SHM))
    proc = subprocess.run([sys.executable, "-m", module, *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"{tool} "), proc.stderr
    assert _orphans(before) == []
    return proc.stderr


@pytest.fixture
def uncreatable(tmp_path) -> str:
    """A directory path nobody can create, root included: its parent is a regular file."""
    (tmp_path / "a-file").write_text("")
    return str(tmp_path / "a-file" / "data")


@pytest.mark.parametrize("key,value,fragment", [
    ("eviction_policy", "nope", "unknown policy 'nope'"),
    ("codec", "nope", "unknown codec 'nope'"),
])
def test_serve_and_config_refuse_unknown_registry_names(tmp_path, key, value, fragment):
    daemon_toml = tmp_path / "daemon.toml"
    daemon_toml.write_text(f'listen = "127.0.0.1:0"\n[store]\n{key} = "{value}"\n')
    store_toml = tmp_path / "store.toml"
    store_toml.write_text(f'{key} = "{value}"\n')
    assert fragment in run_cli("kvstore", "serve", "--config", str(daemon_toml), cwd=tmp_path)
    assert fragment in run_cli("kvstore", "config", "--daemon", "--config", str(daemon_toml), cwd=tmp_path)
    assert fragment in run_cli("kvstore", "config", "--config", str(store_toml), cwd=tmp_path)


def test_serve_on_an_uncreatable_data_dir_leaves_no_shared_memory(tmp_path, uncreatable):
    """The host pool's /dev/shm file exists by the time the disk tier fails: it must go. An
    orphan of a daemon killed earlier is removed on the way, without a second line."""
    orphan = Path(SHM) / f"{PREFIXES[0]}test-{os.getpid()}"
    orphan.write_bytes(b"")
    try:
        err = run_cli("kvstore", "serve", "--listen", "127.0.0.1:0", "--host-bytes", "64MiB",
                      "--data-dir", uncreatable, cwd=tmp_path)
    finally:
        orphan.unlink(missing_ok=True)
    assert uncreatable in err


def test_serve_refuses_more_host_ram_than_the_machine_has_at_once(tmp_path):
    err = run_cli("kvstore", "serve", "--listen", "127.0.0.1:0", "--host-bytes", "100TiB",
                  "--data-dir", str(tmp_path / "data"), cwd=tmp_path)
    assert "100TiB" in err and "physical memory" in err and "e+" not in err


def test_serve_checks_the_metrics_address_first(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        metrics = f"127.0.0.1:{taken.getsockname()[1]}"
        err = run_cli("kvstore", "serve", "--listen", "127.0.0.1:0", "--metrics", metrics,
                      "--host-bytes", "8MiB", "--data-dir", str(tmp_path / "data"), cwd=tmp_path)
    assert metrics in err


def test_kvbench_tiers_on_an_uncreatable_dir(tmp_path, uncreatable):
    assert uncreatable in run_cli("kvbench", "tiers", "--dir", uncreatable, cwd=tmp_path)


def test_kvbench_daemon_without_a_daemon_fails_at_once(tmp_path):
    assert "UNAVAILABLE" in run_cli("kvbench", "daemon", "--addr", f"127.0.0.1:{_free_port()}", cwd=tmp_path)


def _azure_like(path: Path) -> Path:
    with gzip.open(path, "wt") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,374,44\n")
    return path


@pytest.mark.parametrize("command", ["policies", "reuse", "replay"])
def test_kvbench_trace_commands_refuse_what_is_not_a_trace(tmp_path, command):
    junk = tmp_path / "junk.gz"
    junk.write_bytes(b"\x1f\x8b" + os.urandom(2000))
    assert "not a trace" in run_cli("kvbench", command, "--trace", str(ROOT / "README.md"), cwd=tmp_path)
    assert "unreadable trace" in run_cli("kvbench", command, "--trace", str(junk), cwd=tmp_path)
    err = run_cli("kvbench", command, "--trace", str(_azure_like(tmp_path / "azure.csv.gz")), cwd=tmp_path)
    assert "no block hashes" in err
