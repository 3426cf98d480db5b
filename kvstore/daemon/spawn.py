"""Start a daemon as a child process and learn its address from its start-up log line
(benchmarks and tests use it; ``--listen HOST:0`` picks a free port race-free).

The child gets SIGTERM when the thread that started it exits (Linux's parent-death signal),
so a test run or benchmark that dies never leaves daemons, and their /dev/shm files,
behind. Start it from a thread that outlives it (the main thread, in tests and kvbench)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque

_READY = re.compile(r"kvstore daemon listening on (\S+) ")


def _child_limits(max_open_files: int | None) -> list[str]:
    """util-linux commands that set up the child before it runs the daemon: SIGTERM when the
    starting thread exits (``setpriv --pdeathsig``; skipped where setpriv is missing), and at
    most ``max_open_files`` descriptors (``prlimit``).

    Why not a ``preexec_fn``: running Python in a forked child of a process that uses gRPC
    (every test process does) runs gRPC's fork handlers there while other threads are inside
    gRPC; now and then the child then failed before its exec (an epoll_wait error on a bad
    descriptor, and no daemon). Without a ``preexec_fn`` the child only execs."""
    cmd = ["setpriv", f"--pdeathsig={signal.SIGTERM.name[3:]}", "--"] if shutil.which("setpriv") else []
    if max_open_files is not None:
        if not shutil.which("prlimit"):
            raise RuntimeError("limiting a daemon's descriptors needs prlimit (util-linux)")
        cmd += ["prlimit", f"--nofile={max_open_files}:{max_open_files}", "--"]
    return cmd


class DaemonProcess:
    def __init__(self, args: list[str], env: dict[str, str] | None = None, start_timeout_s: float = 60.0,
                 wrapper: list[str] = (), max_open_files: int | None = None) -> None:
        """Run ``python -m kvstore serve *args`` (under the ``wrapper`` command, if any; with
        at most ``max_open_files`` descriptors, if given) and wait until it serves."""
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        full_env = {**os.environ, **(env or {})}
        full_env["PYTHONPATH"] = root + os.pathsep + full_env.get("PYTHONPATH", "")

        self.proc = subprocess.Popen(
            [*_child_limits(max_open_files), *wrapper, sys.executable, "-m", "kvstore", "serve", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=full_env,
        )
        self.log: deque[str] = deque(maxlen=2000)
        self.addr = ""
        ready = threading.Event()
        self._reader = threading.Thread(target=self._read_log, args=(ready,), daemon=True)
        self._reader.start()
        deadline = time.monotonic() + start_timeout_s
        while not ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                self._reader.join(2)
                raise RuntimeError("daemon did not start:\n" + "\n".join(self.log))

    def _read_log(self, ready: threading.Event) -> None:
        for line in self.proc.stderr:
            self.log.append(line.rstrip())
            if not ready.is_set() and (m := _READY.search(line)):
                self.addr = m.group(1)
                ready.set()

    @property
    def text(self) -> str:
        return "\n".join(self.log)

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then wait for a clean exit; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        finally:
            self._reader.join(2)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def __enter__(self) -> "DaemonProcess":
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.stop()
