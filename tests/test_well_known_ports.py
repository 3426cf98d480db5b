"""The suite's daemon and CLI tests pass while something holds the daemon's default address,
127.0.0.1:50051 (the README's daemon running in another shell)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ("127.0.0.1", 50051)
# the daemon's CLI tests, and the serve cases of the CLI error tests (kvbench's take no port)
TESTS = ["tests/test_daemon_cli.py", "tests/test_kvstore_cli.py", "tests/test_cli_errors.py", "-k", "not kvbench"]


def test_daemon_cli_tests_pass_while_the_default_port_is_taken():
    holder = socket.socket()
    try:
        holder.bind(DEFAULT)
        holder.listen(1)
    except OSError:
        holder.close()  # already taken (a running daemon): the condition under test holds anyway
        holder = None
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
                              cwd=ROOT, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        if holder is not None:
            holder.close()
    assert proc.returncode == 0, proc.stdout[-3000:]
