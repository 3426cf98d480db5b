"""Chunks between host staging buffers and the paged KV cache, with the kernels of
``kernels/block_copy`` (Triton on CUDA, the torch references elsewhere).

On CUDA a loader thread copies host -> device on its own stream and waits for that stream
before it reports the chunk loaded, so compute never reads a half-written block; loads only
ever write blocks their request owns alone, so they never race compute on shared ones.
Gathers for saves run on the engine's thread after the forward, on the compute stream, so
they read what the forward wrote.
"""

from __future__ import annotations

import threading

import torch

from connector.metadata import ChunkLoad
from kernels.block_copy import gather_blocks, scatter_blocks, scatter_layer_blocks


class CopyStreams:
    """Each loader thread's own CUDA stream for host -> device copies, waited for before the
    thread reports its chunk loaded; on a CPU, copies just run."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._streams = threading.local()

    def run(self, fn) -> None:
        """Run ``fn`` on this thread's copy stream and wait for it (CUDA), or just run it."""
        if self.device.type != "cuda":
            fn()
            return
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            fn()
        stream.synchronize()


class ChunkMover:
    def __init__(self, kv_cache: torch.Tensor) -> None:
        """``kv_cache``: the engine's ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``."""
        self.kv_cache = kv_cache
        self.block_size = kv_cache.shape[3]
        self.num_layers = kv_cache.shape[0]
        self.cuda = kv_cache.is_cuda
        self.device = kv_cache.device
        self._on_device = CopyStreams(kv_cache.device).run

    def _ids(self, block_ids) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.int64, device=self.kv_cache.device)

    def _source(self, buf: torch.Tensor, load: ChunkLoad) -> torch.Tensor:
        """The part of a staged chunk that goes into the request's own blocks (a session tail
        fills fewer blocks than a chunk has)."""
        start = load.skip_blocks * self.block_size
        return buf[:, :, start:start + len(load.block_ids) * self.block_size]

    def scatter(self, buf: torch.Tensor, load: ChunkLoad) -> None:
        """All layers of one staged chunk into its destination blocks."""
        src = self._source(buf, load)
        self._on_device(lambda: scatter_blocks(src.to(self.kv_cache.device, non_blocking=True), self.kv_cache,
                                               self._ids(load.block_ids)))

    def scatter_layer(self, buf: torch.Tensor, load: ChunkLoad, layer: int) -> None:
        """One layer of one staged chunk into its destination blocks."""
        src = self._source(buf, load)[layer]
        self._on_device(lambda: scatter_layer_blocks(src.to(self.kv_cache.device, non_blocking=True),
                                                     self.kv_cache[layer], self._ids(load.block_ids)))

    def gather(self, block_ids, buf: torch.Tensor) -> None:
        """A chunk's blocks, every layer, into host buffer ``buf``; a tail (fewer blocks than a
        chunk) fills its leading tokens and the rest is zeroed, so a stored tail never holds
        bytes of an earlier use of the buffer."""
        ids = self._ids(block_ids)
        tokens = len(block_ids) * self.block_size
        out = buf[:, :, :tokens] if tokens < buf.shape[2] else buf
        if self.cuda:
            out.copy_(gather_blocks(self.kv_cache, ids))
        else:
            gather_blocks(self.kv_cache, ids, out=out)
        if out is not buf:
            buf[:, :, tokens:].zero_()
