"""Every mistake a newcomer makes with the real ``kvstore`` and ``kvbench`` commands (run as
subprocesses): exit code 2, one line on stderr, no traceback, nothing left in /dev/shm.

Each ``serve`` gets a shared-memory directory of its own under /dev/shm (``[shm] dir``), so
the check sees its files only: daemons of other test runs beside us come and go in /dev/shm.
"""

from __future__ import annotations

import gzip
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvstore.daemon.shmfiles import PREFIXES

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens here once the socket is closed


@pytest.fixture
def shm():
    """A directory on /dev/shm for one test's daemons; it must be empty after each failed start."""
    path = Path(tempfile.mkdtemp(prefix="kvstore-cli-errors-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def daemon_toml(tmp_path: Path, shm: Path, extra: str = "") -> str:
    path = tmp_path / "daemon.toml"
    path.write_text(f'listen = "127.0.0.1:0"\n[shm]\ndir = "{shm}"\n{extra}')
    return str(path)


def run_cli(tool: str, *argv: str, cwd: Path, shm: Path | None = None) -> str:
    """Run ``tool`` (kvstore or kvbench), check it failed as a user error should, return stderr."""
    module = {"kvstore": "kvstore", "kvbench": "bench"}[tool]
    proc = subprocess.run([sys.executable, "-m", module, *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"{tool} "), proc.stderr
    if shm is not None:
        assert sorted(os.listdir(shm)) == []  # its slot arena and host pool are gone
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
def test_serve_and_config_refuse_unknown_registry_names(tmp_path, shm, key, value, fragment):
    config = daemon_toml(tmp_path, shm, f'[store]\n{key} = "{value}"\n')
    store_toml = tmp_path / "store.toml"
    store_toml.write_text(f'{key} = "{value}"\n')
    assert fragment in run_cli("kvstore", "serve", "--config", config, cwd=tmp_path, shm=shm)
    assert fragment in run_cli("kvstore", "config", "--daemon", "--config", config, cwd=tmp_path)
    assert fragment in run_cli("kvstore", "config", "--config", str(store_toml), cwd=tmp_path)


def test_serve_on_an_uncreatable_data_dir_leaves_no_shared_memory(tmp_path, shm, uncreatable):
    """The host pool's /dev/shm file exists by the time the disk tier fails: it must go. An
    orphan of a daemon killed earlier is removed on the way, without a second line."""
    (shm / f"{PREFIXES[0]}of-a-killed-daemon").write_bytes(b"")
    err = run_cli("kvstore", "serve", "--config", daemon_toml(tmp_path, shm), "--host-bytes", "64MiB",
                  "--data-dir", uncreatable, cwd=tmp_path, shm=shm)
    assert uncreatable in err


def test_serve_refuses_more_host_ram_than_the_machine_has_at_once(tmp_path, shm):
    err = run_cli("kvstore", "serve", "--config", daemon_toml(tmp_path, shm), "--host-bytes", "100TiB",
                  "--data-dir", str(tmp_path / "data"), cwd=tmp_path, shm=shm)
    assert "100TiB" in err and "physical memory" in err and "e+" not in err


def test_serve_checks_the_metrics_address_first(tmp_path, shm):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        metrics = f"127.0.0.1:{taken.getsockname()[1]}"
        err = run_cli("kvstore", "serve", "--config", daemon_toml(tmp_path, shm), "--metrics", metrics,
                      "--host-bytes", "8MiB", "--data-dir", str(tmp_path / "data"), cwd=tmp_path, shm=shm)
    assert metrics in err


def test_kvbench_tiers_on_an_uncreatable_dir(tmp_path, uncreatable):
    assert uncreatable in run_cli("kvbench", "tiers", "--dir", uncreatable, cwd=tmp_path)


@pytest.mark.parametrize("command", [["ping"], ["stats"], ["config", "--daemon"]])
def test_asking_a_daemon_that_is_not_there(tmp_path, command):
    assert "UNAVAILABLE" in run_cli("kvstore", *command, "--addr", f"127.0.0.1:{_free_port()}", "--timeout", "2",
                                    cwd=tmp_path)


def test_kvbench_daemon_without_a_daemon_fails_at_once(tmp_path):
    assert "UNAVAILABLE" in run_cli("kvbench", "daemon", "--addr", f"127.0.0.1:{_free_port()}", cwd=tmp_path)


@pytest.mark.parametrize("command", [["replay", "--bogus"], ["replay", "--trace", "README.md"],
                                     ["daemon", "--bogus"], ["daemon", "--addr", "127.0.0.1:{port}"]],
                         ids=["replay typo", "replay not a trace", "daemon typo", "daemon absent"])
def test_kvbench_replay_and_daemon_refuse_without_importing_torch(tmp_path, command):
    """A mistyped argument, a bad trace or an absent daemon is told at once: torch alone takes ~1 s."""
    argv = [a.format(port=_free_port()) for a in command]
    code = ("import sys\nfrom bench.cli import main\ntry:\n    code = main(sys.argv[1:])\n"
            "except SystemExit as exc:\n    code = exc.code\nprint(code, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.split() == ["2", "False"], proc.stderr[-2000:]


def test_kvbench_parser_imports_no_torch():
    """`kvbench --help` and a mistyped command build every subcommand's parser: that must not cost
    the seconds of importing torch, transformers or triton."""
    code = ("import sys, bench.cli\nbench.cli.build_parser()\n"
            "print('loaded:', *(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.split() == ["loaded:"], proc.stdout + proc.stderr[-2000:]


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
