"""Files the daemon shares under /dev/shm (the slot arena, the host pool), and how a daemon
tells a live daemon's files from the orphans of one that died (kill -9 leaves them behind).

A daemon holds an ``flock`` on each of its files for as long as it runs, and the kernel drops
the lock when the process ends, however it ends. An orphan is a file with our prefix that
nobody holds a lock on. That test is right across PID namespaces: containers sharing
/dev/shm share the files and their locks, whereas a process id names nothing in another
namespace (``/proc/<pid>`` would say "dead" about a live daemon next door, or "alive" about
an unrelated process that reused the id). A file is created unnamed (``O_TMPFILE``), locked,
sized and only then linked under its name, so no other daemon ever sees it unlocked.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets

PREFIXES = ("kvstore-slots-", "kvstore-pool-")  # slot arenas, shared host pools
ARENA, POOL = PREFIXES
_NEW = ".kvstore-new-"  # where O_TMPFILE is missing: a hidden name until locked


class SharedFile:
    """A new file under ``directory`` (mode 0600), locked for as long as this object is open."""

    def __init__(self, directory: str, prefix: str, size: int = 0) -> None:
        if prefix not in PREFIXES:
            raise ValueError(f"unknown shared-file prefix {prefix!r}")
        self.path = os.path.join(directory, f"{prefix}{secrets.token_hex(8)}")
        self.fd = _create_locked(directory, self.path, size)

    @classmethod
    def claim(cls, path: str) -> "SharedFile":
        """A file at a configured ``path`` (created if missing, never truncated here), locked
        for as long as the object is open; BlockingIOError if a live process holds it."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            raise
        self = cls.__new__(cls)
        self.path, self.fd = path, fd
        return self

    def close(self) -> None:
        """Unlink the file if it is still ours, then drop the lock."""
        if self.fd < 0:
            return
        try:
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)
        except FileNotFoundError:
            pass  # its user (the host tier) removed it already
        os.close(self.fd)
        self.fd = -1


def _create_locked(directory: str, path: str, size: int) -> int:
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except (AttributeError, OSError):
        return _create_locked_by_rename(directory, path, size)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, size)
        os.link(f"/proc/self/fd/{fd}", path)  # linkat(AT_SYMLINK_FOLLOW): the unnamed file gets its name
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.ENOENT, errno.EXDEV, errno.EPERM):  # no /proc, or links refused
            return _create_locked_by_rename(directory, path, size)
        raise
    return fd


def _create_locked_by_rename(directory: str, path: str, size: int) -> int:
    temp = os.path.join(directory, f"{_NEW}{secrets.token_hex(8)}")
    fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, size)
        os.rename(temp, path)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise
    return fd


def remove_orphans(directory: str) -> int:
    """Delete our files under ``directory`` that no live process holds; returns how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(PREFIXES + (_NEW,)):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # held: its daemon is alive
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:  # still the file we locked
                os.unlink(path)
                removed += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed
