"""GPU tier: chunks in a pool of device memory on the engine's own GPU, the fastest place to
load KV from (a device-to-device copy into the paged cache).

The pool is one ``torch.empty`` of uint8 on the device, taken once (ordinary device memory
from the caching allocator, never managed/unified memory, so nothing migrates behind our
back). Like the host tier, it is cut into fixed-size pages: a value occupies any free pages
(a stack free list: O(1) and mostly contiguous runs), the only waste being its last page's
tail. A value being copied out is pinned, so a delete or replacement meanwhile gives its
pages back only after the copy.

Reads into host buffers copy device -> host; ``read_into_device`` copies into a tensor on
the same device for the engine. Copies run on the caller's current CUDA stream.

Without CUDA the constructor raises ``TierUnavailable`` (the Store goes on without this
tier). ``device="cpu"`` exists only so tests can exercise the page accounting and copies
on machines without a GPU; configurations never use it.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from tiers.base import Buffer, Tier, TierFull, TierUnavailable


@dataclass
class _Value:
    pages: list[int]
    length: int
    runs: list[tuple[int, int]]  # (pool offset, length) in value order
    readers: int = 0
    dead: bool = False


def _bytes_tensor(part) -> torch.Tensor:
    """A flat uint8 tensor over a buffer or tensor's bytes, without copying."""
    if isinstance(part, torch.Tensor):
        return part.contiguous().reshape(-1).view(torch.uint8)
    view = memoryview(part).cast("B")
    if not len(view):
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only sources (bytes) are only ever read
        return torch.frombuffer(view, dtype=torch.uint8)


def _segments(runs: list[tuple[int, int]], sizes: list[int]) -> Iterator[tuple[int, int, int, int]]:
    """Pair a value's page runs with a list of buffers filled in order:
    (pool offset, buffer index, offset in that buffer, length) pieces."""
    index = offset = 0
    for start, length in runs:
        done = 0
        while done < length:
            while offset == sizes[index]:
                index, offset = index + 1, 0
            take = min(length - done, sizes[index] - offset)
            yield start + done, index, offset, take
            done += take
            offset += take


class GpuTier(Tier):
    def __init__(
        self,
        capacity_bytes: int,
        page_bytes: int = 2 << 20,
        device: str = "cuda",
        name: str = "gpu",
    ) -> None:
        super().__init__(name, capacity_bytes)
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise TierUnavailable(f"{name}: no CUDA device is available (torch {torch.__version__}); the GPU tier is off")
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"{name}: device must be a CUDA device, got {device!r}")
        if page_bytes <= 0:
            raise ValueError(f"{name}: page_bytes must be positive, got {page_bytes}")
        self.page_bytes = page_bytes
        self.num_pages = capacity_bytes // page_bytes
        if self.num_pages == 0:
            raise ValueError(f"{name}: capacity_bytes {capacity_bytes} is smaller than one page ({page_bytes})")
        try:
            self._pool = torch.empty(self.num_pages * page_bytes, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError as exc:
            raise TierUnavailable(f"{name}: cannot take {self.num_pages * page_bytes} bytes on {self.device}: {exc}") from exc
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() yields ascending pages
        self._values: dict[bytes, _Value] = {}
        self._lock = threading.Lock()

    # -- pages ------------------------------------------------------------------------------------

    def footprint(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.page_bytes)) * self.page_bytes

    @property
    def used_bytes(self) -> int:
        return (self.num_pages - len(self._free)) * self.page_bytes

    @property
    def free_bytes(self) -> int:
        return len(self._free) * self.page_bytes

    def _runs(self, pages: list[int], length: int) -> list[tuple[int, int]]:
        runs: list[tuple[int, int]] = []
        for i, page in enumerate(pages):
            take = min(self.page_bytes, length - i * self.page_bytes)
            offset = page * self.page_bytes
            if runs and runs[-1][0] + runs[-1][1] == offset:
                runs[-1] = (runs[-1][0], runs[-1][1] + take)
            else:
                runs.append((offset, take))
        return runs

    def _retire(self, value: _Value) -> None:
        """Mark a value gone; its pages return now, or when its last reader is done (lock held)."""
        value.dead = True
        if value.readers == 0:
            self._free.extend(reversed(value.pages))
            value.pages = []

    # -- writes -------------------------------------------------------------------------------------

    def write(self, key: bytes, parts: Sequence[Buffer | torch.Tensor]) -> None:
        """Copy host buffers or tensors (any device) into free pages, then publish the value."""
        sources = [_bytes_tensor(p) for p in parts]
        length = sum(s.numel() for s in sources)
        npages = max(1, -(-length // self.page_bytes))
        with self._lock:
            if len(self._free) < npages:
                raise TierFull(f"{self.name}: need {npages} pages, {len(self._free)} free")
            pages = [self._free.pop() for _ in range(npages)]
        value = _Value(pages=pages, length=length, runs=self._runs(pages, length))
        sizes = [s.numel() for s in sources]
        for start, i, offset, n in _segments(value.runs, sizes):
            self._pool[start : start + n].copy_(sources[i][offset : offset + n])
        with self._lock:
            old = self._values.get(key)
            self._values[key] = value
            if old is not None:
                self._retire(old)

    # -- reads ----------------------------------------------------------------------------------------

    def _copy_out(self, key: bytes, outs: list[torch.Tensor]) -> int | None:
        with self._lock:
            value = self._values.get(key)
            if value is None:
                return None
            capacity = sum(o.numel() for o in outs)
            if value.length > capacity:
                raise ValueError(f"{self.name}: buffer of {capacity} bytes is too small for {value.length}")
            value.readers += 1
        try:
            for start, i, offset, n in _segments(value.runs, [o.numel() for o in outs]):
                outs[i][offset : offset + n].copy_(self._pool[start : start + n])
            return value.length
        finally:
            with self._lock:
                value.readers -= 1
                if value.dead and value.readers == 0:
                    self._retire(value)

    def read_into(self, key: bytes, out) -> int | None:
        """Copy the value device -> host into ``out`` (one buffer or a list, filled in order)."""
        return self._copy_out(key, [_bytes_tensor(o) for o in (out if isinstance(out, (list, tuple)) else [out])])

    def read_into_device(self, key: bytes, out: torch.Tensor) -> int | None:
        """Copy the value into a contiguous tensor on this tier's device (for the engine)."""
        if out.device != self._pool.device or not out.is_contiguous():
            raise ValueError(f"{self.name}: out must be a contiguous tensor on {self._pool.device}, got {out.device}")
        return self._copy_out(key, [out.reshape(-1).view(torch.uint8)])

    def read(self, key: bytes) -> bytes | None:
        size = self.size_of(key)
        if size is None:
            return None
        buf = bytearray(size)
        got = self.read_into(key, buf)
        return None if got is None else bytes(buf[:got])

    # -- the rest of the interface ------------------------------------------------------------------

    def delete(self, key: bytes) -> bool:
        with self._lock:
            value = self._values.pop(key, None)
            if value is None:
                return False
            self._retire(value)
            return True

    def contains(self, key: bytes) -> bool:
        return key in self._values

    def size_of(self, key: bytes) -> int | None:
        value = self._values.get(key)
        return None if value is None else value.length

    def keys(self) -> Iterator[bytes]:
        with self._lock:
            return iter(list(self._values))

    def __len__(self) -> int:
        return len(self._values)

    def close(self) -> None:
        with self._lock:
            self._values.clear()
        self._pool = None
