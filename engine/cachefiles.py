"""Temporary names for the caches kept beside a model file, and the clean-up they allow.

A cache is built under a temporary name and renamed into place, so a reader sees a whole
cache or none. A writer killed before the rename leaves its temporary (hundreds of MB)
behind for ever, so the name says which host and process wrote it: a later writer removes
the ones whose process is gone, and never one that a live process may still be writing.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
from pathlib import Path


def temp_path(final: Path) -> Path:
    """A fresh temporary name beside ``final`` that names this host and process."""
    return final.with_name(f".{final.name}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def remove_dead_temps(final: Path) -> None:
    """Remove the temporaries of ``final`` left by processes of this host that are gone.
    Another host's cannot be checked (its pids are not ours), so they stay."""
    pattern = re.compile(rf"\.{re.escape(final.name)}\.{re.escape(socket.gethostname())}\.(\d+)\.[0-9a-f]{{8}}\.tmp")
    try:
        entries = list(final.parent.iterdir())
    except OSError:
        return
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m and not pid_alive(int(m.group(1))):
            remove(entry)


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists here (another user's counts: it may be a writer)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def remove(path: Path) -> None:
    """Remove a file or folder, if we can: one already gone (another process removed it) or
    not ours to remove (another user's) only stays, it never fails the load of a model."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except OSError:
        pass
