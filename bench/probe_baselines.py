"""Naive 50%-budget codecs the quality probe sets beside ours; never registered or stored.

- ``naive50-random``: mixed50's levels and budget, but rows ranked at random, which shows
  what the key-norm ranking is worth.
- ``naive50-truncate``: every value keeps only the high half of its bytes (fp16 becomes
  e5m2, bf16 keeps sign, exponent and one mantissa bit, fp32 becomes bf16), the uniform
  per-token truncation of the SpectrumKV paper's comparison.
"""

from __future__ import annotations

import torch

from kvstore.codecs.base import Codec
from kvstore.codecs.mixed import MixedPrecisionCodec
from kvstore.codecs.raw import tensor_bytes

NOT_STORED = -1  # baselines have no on-disk id


class RandomRankCodec(MixedPrecisionCodec):
    def __init__(self, seed: int = 0):
        super().__init__(0.50, "naive50-random", NOT_STORED)
        self.seed = seed

    def importance(self, keys: torch.Tensor) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed)
        return torch.rand(keys.shape[:2], generator=generator)


class TruncateCodec(Codec):
    name = "naive50-truncate"
    codec_id = NOT_STORED
    lossless = False

    def encode(self, tensor: torch.Tensor) -> bytes:
        size = tensor.element_size()
        planes = tensor.contiguous().reshape(-1).view(torch.uint8).reshape(-1, size)
        return tensor_bytes(planes[:, size // 2 :].contiguous()).tobytes()

    def decode_into(self, payload, out: torch.Tensor) -> None:
        size = out.element_size()
        high = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if high.numel() != out.numel() * (size - size // 2):
            raise ValueError("truncate payload has the wrong length")
        planes = out.reshape(-1).view(torch.uint8).reshape(-1, size)
        planes[:, : size // 2] = 0
        planes[:, size // 2 :] = high.reshape(-1, size - size // 2)


def baselines() -> list[Codec]:
    return [RandomRankCodec(), TruncateCodec()]
