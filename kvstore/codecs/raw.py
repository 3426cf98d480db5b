"""The identity codec: the payload is the tensor's bytes in C order, little-endian."""

from __future__ import annotations

import torch

from kvstore.codecs.base import Codec


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (bf16 included)."""
    if tensor.device.type != "cpu":
        raise ValueError("tensor must be on the CPU")
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous")
    return memoryview(tensor.view(torch.uint8).reshape(-1).numpy())


class RawCodec(Codec):
    name = "raw"
    codec_id = 0
    lossless = True

    def encode(self, tensor: torch.Tensor) -> memoryview:
        return tensor_bytes(tensor)

    def decode_into(self, payload, out: torch.Tensor) -> None:
        dst = tensor_bytes(out)
        if len(payload) != len(dst):
            raise ValueError(f"raw payload is {len(payload)} bytes, tensor needs {len(dst)}")
        dst[:] = payload
