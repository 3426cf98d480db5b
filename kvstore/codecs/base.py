"""The Codec interface: how a chunk's tensor becomes a blob payload and back.

A codec is chosen per chunk and its id is recorded in the blob header, so a reader never
has to guess. Lossy codecs declare it, so placement can weigh their quality cost.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch


class Codec(ABC):
    """Encodes a KV tensor into bytes and decodes them back to the same shape and dtype."""

    name: ClassVar[str]
    codec_id: ClassVar[int]  # stable on-disk id: never reuse or renumber
    lossless: ClassVar[bool]

    @abstractmethod
    def encode(self, tensor: torch.Tensor) -> bytes | memoryview:
        """Payload bytes for a contiguous CPU tensor; may be a view into ``tensor``."""

    @abstractmethod
    def decode_into(self, payload: bytes | memoryview, out: torch.Tensor) -> None:
        """Decode straight into a caller's contiguous tensor of the encoded shape and dtype."""

    def decode(self, payload: bytes | memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor of ``shape`` and ``dtype`` that ``payload`` encodes."""
        out = torch.empty(shape, dtype=dtype)
        self.decode_into(payload, out)
        return out
