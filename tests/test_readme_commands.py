"""Every shell command the README shows runs as written and does what its comment says.

Commands are the README's indented lines that start with ``./scripts/``, ``.venv/bin/`` or
``printf``; each must be claimed by one test here, so a command added to the README without
a test fails ``test_every_readme_command_is_run_by_a_test``. The only liberties taken: a
daemon's address (tests never use the well-known port) and the data directory
(``XDG_CACHE_HOME`` points at a temporary folder). Quick ones run in CI; the benchmarks,
minutes each, under ``-m long``. ``./scripts/test.sh`` is the command CI itself runs.
"""

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from kvstore.daemon.spawn import DaemonProcess

ROOT = Path(__file__).parents[1]
COMMANDS = [line.strip() for line in re.findall(r"^    ((?:\./scripts/|\.venv/bin/|printf ).*)$",
                                                (ROOT / "README.md").read_text(), re.M)]
KVSTORE = [c for c in COMMANDS if c.startswith(".venv/bin/kvstore ")]
KVBENCH = [c for c in COMMANDS if c.startswith(".venv/bin/kvbench ")]
ENGINE = [c for c in COMMANDS if c.startswith(("printf ", ".venv/bin/python -m engine "))]
SCRIPTS = [c for c in COMMANDS if c.startswith("./scripts/")]


def test_every_readme_command_is_run_by_a_test():
    assert COMMANDS and sorted(KVSTORE + KVBENCH + ENGINE + SCRIPTS) == sorted(COMMANDS)
    # run.sh (also started in the background in the vLLM section); test.sh: what .ci/run runs
    assert {without_comment(c).removesuffix(" &") for c in SCRIPTS} == {"./scripts/run.sh", "./scripts/test.sh"}


def shell(command: str, env: dict, timeout: float, **kw) -> subprocess.CompletedProcess:
    """``command`` as a user types it, in bash, from the checkout's root."""
    return subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, **kw)


def without_comment(command: str) -> str:
    return command.split("  #", 1)[0].strip()


@pytest.fixture
def user_env(tmp_path):
    return {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}


def test_run_sh_starts_the_daemon(user_env):
    """``./scripts/run.sh`` (extra arguments go to ``kvstore serve``): the daemon serves, and
    ends on SIGTERM."""
    proc = subprocess.Popen(["bash", "scripts/run.sh", "--listen", "127.0.0.1:0"], cwd=ROOT, env=user_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if m := re.search(r"kvstore daemon listening on (\S+) ", line):
                break
        else:
            pytest.fail(f"run.sh ended with {proc.wait()} before serving")
        done = shell(f".venv/bin/kvstore ping --addr {m.group(1)}", user_env, 60)
        assert done.returncode == 0 and "SERVING" in done.stdout
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)


@pytest.fixture
def daemon(user_env):
    with DaemonProcess(["--listen", "127.0.0.1:0"], env=user_env) as proc:
        yield proc


@pytest.mark.parametrize("command", KVSTORE)
def test_kvstore_commands(command, daemon, user_env):
    command = without_comment(command)
    line = f"{command} --addr {daemon.addr}" if " fsck" not in command else command
    if "--watch" in command:  # live until Ctrl-C: two frames, then SIGINT, one clean exit
        proc = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=ROOT, env=user_env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        frames = 0
        for text in proc.stdout:
            frames += text.startswith("host")
            if frames == 2:
                break
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) in (0, 130) and "Traceback" not in proc.stderr.read()
        return
    done = shell(line, user_env, 120)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout.strip()


@pytest.mark.long
@pytest.mark.parametrize("command", KVBENCH)
def test_kvbench_commands(command, user_env):
    done = shell(without_comment(command), user_env, 3 * 3600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() and "Traceback" not in done.stderr


def test_the_engine_command_loads_on_its_second_run(user_env):
    """Run twice as written: the first computes and saves, the second (a new process, the
    in-process store's disk tier) loads all but the last partial block, with the same text."""
    (command,) = ENGINE
    runs = [shell(command, user_env, 900) for _ in range(2)]
    for done in runs:
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
    summary = [re.search(r"\[(\d+) prompt tokens \((\d+) cached, (\d+) loaded from the store\)", d.stderr) for d in runs]
    (prompt, _, first), (_, _, second) = (tuple(map(int, m.groups())) for m in summary)
    assert first == 0 and second == (prompt - 1) // 16 * 16 and prompt > 1000
    assert runs[0].stdout == runs[1].stdout
