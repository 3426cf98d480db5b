"""glibc heap settings for processes that move chunks. Keep large blocks in the heap:
chunk-sized buffers (4-16 MiB) are otherwise mmap'ed and unmapped on every allocation, and
each fresh mapping pays page faults on first touch, which caps large-message throughput far
below memcpy speed. And, for the daemon, few arenas (``limit_arenas``)."""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8


_done = False


def keep_large_blocks_in_heap() -> bool:
    """Raise glibc's mmap/trim thresholds for this process (once); False where not glibc."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(M_MMAP_THRESHOLD, 32 << 20)  # glibc's maximum on 64-bit
    ok &= mallopt(M_TRIM_THRESHOLD, 1 << 30)
    ok &= mallopt(M_TOP_PAD, 64 << 20)
    _done = bool(ok)
    return _done


def limit_arenas(count: int) -> bool:
    """At most ``count`` glibc malloc arenas in this process (False where not glibc). With
    untrimmed heaps, each of the many threads of a long-running daemon otherwise fragments
    an arena of its own: the daemon's RSS crept up ~1 MB a minute in a soak with the Python
    heap flat, and stayed flat with one arena."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        return bool(ctypes.CDLL(name).mallopt(M_ARENA_MAX, count))
    except (OSError, AttributeError):
        return False
