"""A value written to a file with O_DIRECT, from the views it is given.

A buffered write costs a core copying the bytes into the page cache (0.18-0.26 CPU s/GB
here, against 0.03 for O_DIRECT), and on a 2-core machine that core is the one a put into
host RAM runs beside; the page cache then holds a second copy of bytes host RAM holds
already. O_DIRECT needs every buffer address, length and file offset aligned to the
device's block: views that are (the host tier's pages are) go to the device as they are,
the rest pass through a small aligned bounce buffer, and the last partial block is written
padded with zeros, then cut back to the value's length with ``ftruncate``.

A write returns when the device has every byte: nothing reads the views afterwards.
"""

from __future__ import annotations

import mmap
import os
from typing import Sequence

import numpy as np

from tiers.files import skip

ALIGN = 4096  # covers every logical block size Linux file systems use for O_DIRECT
BOUNCE_BYTES = 1 << 20
IOV_MAX = 1024


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


class DirectWriter:
    """Writes one file's bytes in order through ``fd`` (opened with O_DIRECT at offset 0).

    ``bounce`` is an aligned buffer the caller owns (one per thread): it is reused for the
    next file once ``finish`` returns."""

    def __init__(self, fd: int, bounce: mmap.mmap) -> None:
        self.fd = fd
        self.bounce = memoryview(bounce)
        self.fill = 0  # bytes waiting in the bounce buffer
        self.direct: list[memoryview] = []  # aligned views waiting, all before the bounce bytes
        self.written = 0

    def add(self, view: memoryview) -> None:
        while len(view):
            if self.fill % ALIGN == 0 and _address(view) % ALIGN == 0 and len(view) >= ALIGN:
                if self.fill:
                    self._flush()  # the bounce bytes go first: they come before this view
                n = len(view) - len(view) % ALIGN
                self.direct.append(view[:n])
                view = view[n:]
                if len(self.direct) == IOV_MAX:
                    self._flush()
                continue
            take = min(len(view), len(self.bounce) - self.fill)
            self.bounce[self.fill : self.fill + take] = view[:take]
            self.fill += take
            view = view[take:]
            if self.fill == len(self.bounce):
                self._flush()

    def finish(self, length: int) -> None:
        """Write what is waiting (the last block padded), then cut the file to ``length``."""
        if self.fill % ALIGN:
            pad = ALIGN - self.fill % ALIGN
            self.bounce[self.fill : self.fill + pad] = bytes(pad)
            self.fill += pad
        self._flush()
        if self.written != length:
            os.ftruncate(self.fd, length)

    def _flush(self) -> None:
        pending = self.direct + ([self.bounce[: self.fill]] if self.fill else [])
        want = sum(len(p) for p in pending)
        done = 0
        while done < want:
            done += os.pwritev(self.fd, skip(pending, done), self.written + done)
        self.written += want
        self.direct, self.fill = [], 0


def write_direct(fd: int, views: Sequence[memoryview], bounce: mmap.mmap) -> None:
    """Write ``views`` in order as the whole file behind ``fd`` (O_DIRECT, offset 0)."""
    writer = DirectWriter(fd, bounce)
    for v in views:
        writer.add(v)
    writer.finish(sum(len(v) for v in views))


def bounce_buffer() -> mmap.mmap:
    """An aligned bounce buffer for ``DirectWriter`` (anonymous memory is page-aligned)."""
    return mmap.mmap(-1, BOUNCE_BYTES)
