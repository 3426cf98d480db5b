"""Real file-system faults for tests: a tiny tmpfs (a disk that fills up) that can be
remounted read-only. Needs root and mount(2); tests skip with the reason otherwise."""

from __future__ import annotations

import contextlib
import subprocess

import pytest


@contextlib.contextmanager
def tiny_tmpfs(path, size_bytes: int):
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for fault tests: {result.stderr.strip() or 'not permitted'}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount_read_only(path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, capture_output=True)


def remount_read_write(path) -> None:
    subprocess.run(["mount", "-o", "remount,rw", str(path)], check=True, capture_output=True)
