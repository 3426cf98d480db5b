"""Worker processes (bench/attacks/worker.py) started and killed by the attacks."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker(*args) -> subprocess.Popen:
    """``python -m bench.attacks.worker *args``, its stdout a pipe of progress lines."""
    return subprocess.Popen([sys.executable, "-m", "bench.attacks.worker", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})


def wait_for_line(proc: subprocess.Popen, prefix: str, limit: int = 100_000) -> str:
    """The first line of ``proc``'s output starting with ``prefix`` (RuntimeError if it ends first)."""
    for _ in range(limit):
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker ended before saying {prefix!r}: {proc.stderr.read()[-2000:]}")
        if line.startswith(prefix):
            return line.strip()
    raise RuntimeError(f"worker never said {prefix!r}")
