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

import warnings
from typing import Sequence

import torch

from tiers.base import Buffer, TierUnavailable, as_buffers
from tiers.pages import PagedTier, segments


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


class GpuTier(PagedTier):
    def __init__(
        self,
        capacity_bytes: int,
        page_bytes: int = 2 << 20,
        device: str = "cuda",
        name: str = "gpu",
    ) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise TierUnavailable(f"{name}: no CUDA device is available (torch {torch.__version__}); the GPU tier is off")
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"{name}: device must be a CUDA device, got {device!r}")
        super().__init__(name, capacity_bytes, page_bytes)
        try:
            self._pool = torch.empty(self.table.pool_bytes, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError as exc:
            raise TierUnavailable(f"{name}: cannot take {self.table.pool_bytes} bytes on {self.device}: {exc}") from exc

    # -- writes -------------------------------------------------------------------------------------

    def write(self, key: bytes, parts: Sequence[Buffer | torch.Tensor]) -> None:
        """Copy host buffers or tensors (any device) into free pages, then publish the value."""
        sources = [_bytes_tensor(p) for p in parts]
        value = self.table.allocate(sum(s.numel() for s in sources))
        for start, i, offset, n in segments(value.runs, [s.numel() for s in sources]):
            self._pool[start : start + n].copy_(sources[i][offset : offset + n])
        self.table.publish(key, value)

    # -- reads ----------------------------------------------------------------------------------------

    def _copy_out(self, key: bytes, outs: list[torch.Tensor]) -> int | None:
        with self.table.reading(key, capacity=sum(o.numel() for o in outs)) as value:
            if value is None:
                return None
            for start, i, offset, n in segments(value.runs, [o.numel() for o in outs]):
                outs[i][offset : offset + n].copy_(self._pool[start : start + n])
            return value.length

    def read_into(self, key: bytes, out) -> int | None:
        """Copy the value device -> host into ``out`` (one buffer or a list, filled in order)."""
        return self._copy_out(key, [_bytes_tensor(o) for o in as_buffers(out)])

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

    def close(self) -> None:
        self.table.clear()
        self._pool = None
