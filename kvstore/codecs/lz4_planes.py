"""Lossless codec: LZ4 over byte planes of the tensor's elements.

The bytes of a float's sign and exponent repeat far more often than its low mantissa
bytes, so LZ4 (which only finds repeated byte runs) compresses much better when each
byte position is gathered into its own plane. Planes LZ4 cannot shrink are stored as
they are, so a payload is never more than a few bytes larger than the raw tensor.

Five-dimensional chunks ``[layers, 2, tokens, heads, head_dim]`` are put in channel-major
order ``[layers, 2, heads, head_dim, tokens]`` first: one channel's exponents barely change
from token to token, which gives LZ4 longer runs. Layout: docs/codecs.md.
"""

from __future__ import annotations

import struct

import lz4.block
import numpy as np
import torch

from kvstore.codecs.base import Codec
from kvstore.codecs.raw import tensor_bytes

VERSION = 1
STORED, LZ4 = 0, 1
_HEAD = struct.Struct("<BB")  # version, plane count
_PLANE = struct.Struct("<BI")  # mode, length


def _channel_major(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.permute(0, 1, 3, 4, 2) if tensor.dim() == 5 else tensor


class Lz4PlanesCodec(Codec):
    name = "lz4"
    codec_id = 1
    lossless = True

    def encode(self, tensor: torch.Tensor) -> bytes:
        flat = _channel_major(tensor).reshape(-1).contiguous().view(torch.uint8).reshape(-1, tensor.element_size())
        planes = flat.t().contiguous()
        parts = [_HEAD.pack(VERSION, planes.shape[0])]
        for plane in planes:
            raw = tensor_bytes(plane)
            packed = lz4.block.compress(raw, store_size=False) if len(raw) else b""
            mode, data = (LZ4, packed) if len(packed) < len(raw) else (STORED, raw)
            parts += [_PLANE.pack(mode, len(data)), data]
        return b"".join(parts)

    def decode(self, payload, shape, dtype) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        self.decode_into(payload, out)
        return out

    def decode_into(self, payload, out: torch.Tensor) -> None:
        view = memoryview(payload).cast("B")
        esize = out.element_size()
        count = out.numel()
        if len(view) < _HEAD.size:
            raise ValueError("lz4 payload is truncated")
        version, nplanes = _HEAD.unpack_from(view, 0)
        if version != VERSION or nplanes != esize:
            raise ValueError(f"lz4 payload has version {version} and {nplanes} planes; expected {VERSION}, {esize}")
        planes = torch.empty((esize, count), dtype=torch.uint8)
        pos = _HEAD.size
        for i in range(esize):
            if len(view) < pos + _PLANE.size:
                raise ValueError("lz4 payload is truncated")
            mode, length = _PLANE.unpack_from(view, pos)
            pos += _PLANE.size
            data = view[pos : pos + length]
            pos += length
            if len(data) != length:
                raise ValueError("lz4 payload is truncated")
            planes[i].numpy()[:] = _plane(mode, data, count)
        if pos != len(view):
            raise ValueError(f"lz4 payload has {len(view) - pos} trailing bytes")
        elements = planes.t().contiguous().reshape(-1).view(out.dtype)
        _channel_major(out).copy_(elements.reshape(_channel_major(out).shape))


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
