"""Ctrl-C in a terminal (SIGINT to the whole process group, children included) ends a
``kvbench`` run and ``python -m engine generate`` within a second: one line, exit code 130, no
traceback, and no process of the run left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine.testing import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
LIMIT_S = 1.5  # the promise is a second; the rest is slack for this shared machine's scheduler


def _group_alive(pgid: int) -> list[str]:
    """The processes of group ``pgid`` that still run (zombies, waiting for a reaper, do not)."""
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
    return alive


def interrupt(argv: list[str], marker: str, start_timeout_s: float = 240.0) -> tuple[int, float, list[str]]:
    """Run ``argv`` in a session of its own, send its process group SIGINT once ``marker`` is on
    stderr; return the exit code, the seconds from the signal to the exit, and the stderr lines
    that came after the signal."""
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines: list[str] = []
    seen = threading.Event()
    sent: list[int] = []

    def read():
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            if marker in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert seen.wait(start_timeout_s), f"{marker!r} never came:\n" + "\n".join(lines[-20:])
        sent.append(len(lines))
        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(30)
        elapsed = time.monotonic() - start
        reader.join(10)
        deadline = time.monotonic() + 60  # a daemon told to stop flushes and exits on its own
        while (left := _group_alive(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"left running: {left}"
    finally:
        if proc.poll() is None or _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    return code, elapsed, lines[sent[0]:]


def test_ctrl_c_ends_kvbench_pd_while_its_engines_and_daemons_start(tmp_path):
    """The hardest moment: two daemons up, engine processes starting in worker threads. (Its
    files are in ``--dir``: a run cut short leaves them, here for pytest to remove.)"""
    code, elapsed, after = interrupt([sys.executable, "-m", "bench", "pd", "--quick", "--codecs", "mixed50",
                                      "--dir", str(tmp_path / "pd")], "[pd] starting engines")
    assert after == ["kvbench pd: interrupted"] and code == 130
    assert elapsed < LIMIT_S


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama", max_position_embeddings=8192)


def test_ctrl_c_ends_engine_generate_mid_decode(tiny):
    code, elapsed, after = interrupt([sys.executable, "-m", "engine", "generate", "--model", str(tiny), "--prompt",
                                      "hi", "--max-tokens", "8000", "--num-blocks", "1024"], "engine: ")
    assert after == ["engine generate: interrupted"] and code == 130
    assert elapsed < LIMIT_S
