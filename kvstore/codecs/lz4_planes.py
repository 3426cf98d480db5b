"""Lossless codec: LZ4 over byte planes of the tensor's elements.

The bytes of a float's sign and exponent repeat far more often than its low mantissa
bytes, so LZ4 (which only finds repeated byte runs) compresses much better when each
byte position is gathered into its own plane. Planes LZ4 cannot shrink are stored as
they are, so a payload is never more than a few bytes larger than the raw tensor.
Planes are split and merged with numpy, whose strided byte copies run at memory speed.
Layout: docs/codecs.md.
"""

from __future__ import annotations

import struct

import lz4.block
import numpy as np
import torch

from kvstore.codecs.base import Codec

VERSION = 1
STORED, LZ4 = 0, 1
_HEAD = struct.Struct("<BB")  # version, plane count
_PLANE = struct.Struct("<BI")  # mode, length


def _element_bytes(tensor: torch.Tensor) -> np.ndarray:
    """``[numel, element_size]`` uint8 view of a contiguous CPU tensor, in C order."""
    return tensor.reshape(-1).view(torch.uint8).numpy().reshape(-1, tensor.element_size())


class Lz4PlanesCodec(Codec):
    name = "lz4"
    codec_id = 1
    lossless = True

    def encode(self, tensor: torch.Tensor) -> bytes:
        elements = _element_bytes(tensor.contiguous())
        parts = [_HEAD.pack(VERSION, elements.shape[1])]
        for p in range(elements.shape[1]):
            raw = np.ascontiguousarray(elements[:, p])
            packed = lz4.block.compress(raw, store_size=False) if raw.size else b""
            mode, data = (LZ4, packed) if len(packed) < raw.size else (STORED, raw.tobytes())
            parts += [_PLANE.pack(mode, len(data)), data]
        return b"".join(parts)

    def decode_into(self, payload, out: torch.Tensor) -> None:
        target = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype)
        elements = _element_bytes(target)
        view = memoryview(payload).cast("B")
        if len(view) < _HEAD.size:
            raise ValueError("lz4 payload is truncated")
        version, planes = _HEAD.unpack_from(view, 0)
        if version != VERSION or planes != elements.shape[1]:
            raise ValueError(f"lz4 payload has version {version} and {planes} planes; expected {VERSION}, {elements.shape[1]}")
        pos = _HEAD.size
        for p in range(planes):
            if len(view) < pos + _PLANE.size:
                raise ValueError("lz4 payload is truncated")
            mode, length = _PLANE.unpack_from(view, pos)
            pos += _PLANE.size
            if len(view) < pos + length:
                raise ValueError("lz4 payload is truncated")
            elements[:, p] = _plane(mode, view[pos : pos + length], elements.shape[0])
            pos += length
        if pos != len(view):
            raise ValueError(f"lz4 payload has {len(view) - pos} trailing bytes")
        if target is not out:
            out.copy_(target)


def _plane(mode: int, data: memoryview, count: int) -> np.ndarray:
    """One plane's ``count`` bytes."""
    if mode == STORED:
        raw = data
    elif mode == LZ4:
        try:
            raw = lz4.block.decompress(data, uncompressed_size=count) if count else b""
        except lz4.block.LZ4BlockError as exc:
            raise ValueError(f"lz4 plane does not decompress: {exc}") from None
    else:
        raise ValueError(f"lz4 plane has unknown mode {mode}")
    if len(raw) != count:
        raise ValueError(f"lz4 plane holds {len(raw)} bytes, expected {count}")
    return np.frombuffer(raw, dtype=np.uint8)
