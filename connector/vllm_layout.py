"""vLLM's per-layer paged KV caches, seen in our chunk layout, and the copies between them
and chunk buffers.

vLLM hands a connector one tensor per attention layer, laid out as its attention backend
wants; the store keeps chunks in one layout for every engine, ``[layers, 2, tokens, kv_heads,
head_dim]`` (``LKTHD``). Each layer's tensor is viewed, without a copy, as ``[2, num_blocks,
block_size, kv_heads, head_dim]`` (the bundled engine's per-layer layout); loads and saves copy
runs of consecutive blocks through those views, so the store's bytes are the same whichever
backend wrote them. The layout is read from the tensor's shape (``layout_of``):

- ``cpu``: vLLM's CPU attention, ``[num_blocks, kv_heads, block_size, 2 * head_dim]``, whose
  memory per (block, head) is ``block_size`` rows of K, then ``block_size`` rows of V
  (``vllm/v1/attention/backends/cpu_attn.py`` views it as ``[blocks, heads, 2 * block_size,
  head_dim]`` and splits dim 2);
- ``flash``: flash-attention on a GPU, ``[2, num_blocks, block_size, kv_heads, head_dim]``;
- ``flashinfer``: ``[num_blocks, 2, block_size, kv_heads, head_dim]``.
"""

from __future__ import annotations

import torch

from connector.metadata import ChunkLoad
from connector.transfer import CopyStreams
from kernels.block_copy import block_runs

LAYOUTS = ("cpu", "flash", "flashinfer")


class UnknownLayoutError(ValueError):
    """A KV tensor whose shape matches none of the layouts this connector knows."""


def layout_of(kv: torch.Tensor, block_size: int, kv_heads: int, head_dim: int) -> str:
    """Which of ``LAYOUTS`` a layer's KV tensor has, from its shape alone."""
    shape = tuple(kv.shape)
    if len(shape) == 4 and shape[1:] == (kv_heads, block_size, 2 * head_dim):
        return "cpu"
    if len(shape) == 5 and shape[2:] == (block_size, kv_heads, head_dim):
        if shape[0] == 2 and shape[1] != 2:
            return "flash"
        if shape[1] == 2 and shape[0] != 2:
            return "flashinfer"
    raise UnknownLayoutError(f"KV tensor of shape {shape} is in no known layout for block_size {block_size}, "
                             f"{kv_heads} kv heads, head_dim {head_dim} (known: {', '.join(LAYOUTS)})")


def blocks_view(kv: torch.Tensor, layout: str) -> torch.Tensor:
    """``kv`` as ``[2, num_blocks, block_size, kv_heads, head_dim]``, sharing its memory."""
    if layout == "cpu":
        blocks, heads, block_size, two_dim = kv.shape
        return kv.view(blocks, heads, 2, block_size, two_dim // 2).permute(2, 0, 3, 1, 4)
    if layout == "flash":
        return kv
    if layout == "flashinfer":
        return kv.transpose(0, 1)
    raise UnknownLayoutError(f"unknown layout {layout!r} (known: {', '.join(LAYOUTS)})")


class PagedLayers:
    """``connector.transfer.ChunkMover``'s interface over one view per layer, so the worker
    side's loads, saves and threads (``connector.worker.WorkerConnector``) run unchanged on
    vLLM's caches. Copies go run by run of consecutive blocks (one strided copy each)."""

    def __init__(self, layers: list[torch.Tensor]) -> None:
        """``layers``: each ``[2, num_blocks, block_size, kv_heads, head_dim]`` (``blocks_view``)."""
        if not layers:
            raise ValueError("no KV layers to move")
        self.layers = layers
        self.block_size = layers[0].shape[2]
        self.num_layers = len(layers)
        self.dtype = layers[0].dtype
        self.cuda = layers[0].is_cuda
        self.device = layers[0].device
        self._on_device = CopyStreams(layers[0].device).run

    def _runs(self, block_ids) -> list[tuple[int, int, int]]:
        return block_runs(torch.as_tensor(block_ids, dtype=torch.int64))

    def scatter_layer(self, buf: torch.Tensor, load: ChunkLoad, layer: int) -> None:
        """One layer of a staged chunk (``[layers, 2, tokens, heads, dim]``) into its blocks,
        past the ``load.skip_blocks`` the request shares with vLLM's prefix cache."""
        start = load.skip_blocks * self.block_size
        src = buf[layer, :, start:start + len(load.block_ids) * self.block_size]
        dst = self.layers[layer]
        blocks = src.unflatten(1, (len(load.block_ids), self.block_size)).to(dst.device, non_blocking=True)

        def copy() -> None:
            for first, at, length in self._runs(load.block_ids):
                dst[:, first:first + length].copy_(blocks[:, at:at + length])

        self._on_device(copy)

    def scatter(self, buf: torch.Tensor, load: ChunkLoad) -> None:
        """Every layer of a staged chunk into its blocks."""
        for layer in range(self.num_layers):
            self.scatter_layer(buf, load, layer)

    def gather(self, block_ids, buf: torch.Tensor) -> None:
        """A chunk's blocks, every layer, into host buffer ``buf`` (``[layers, 2, tokens, heads, dim]``);
        a tail (fewer blocks than a chunk) fills the leading tokens and the rest is zeroed."""
        runs = self._runs(block_ids)
        tokens = len(block_ids) * self.block_size
        if tokens < buf.shape[2]:
            buf[:, :, tokens:].zero_()
        for layer, src in enumerate(self.layers):
            out = buf[layer, :, :tokens].unflatten(1, (len(block_ids), self.block_size))
            for first, at, length in runs:
                out[:, at:at + length].copy_(src[:, first:first + length])
