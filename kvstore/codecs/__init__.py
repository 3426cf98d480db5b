"""Codec registry: codecs by name (configuration) and by id (blob headers)."""

from __future__ import annotations

from kvstore.codecs.base import Codec
from kvstore.codecs.int4 import Int4Codec
from kvstore.codecs.int8 import Int8Codec
from kvstore.codecs.lz4_planes import Lz4PlanesCodec
from kvstore.codecs.mixed import MixedPrecisionCodec
from kvstore.codecs.raw import RawCodec
from kvstore.config import BUILTIN_CODECS

_BY_NAME: dict[str, Codec] = {}
_BY_ID: dict[int, Codec] = {}


def register(codec: Codec) -> Codec:
    """Add a codec instance; names and ids must be unique."""
    if codec.name in _BY_NAME or codec.codec_id in _BY_ID:
        raise ValueError(f"codec {codec.name!r} (id {codec.codec_id}) is already registered")
    _BY_NAME[codec.name] = codec
    _BY_ID[codec.codec_id] = codec
    return codec


def get_codec(name: str) -> Codec:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown codec {name!r}; known: {sorted(_BY_NAME)}") from None


def codec_by_id(codec_id: int) -> Codec:
    try:
        return _BY_ID[codec_id]
    except KeyError:
        raise KeyError(f"unknown codec id {codec_id}") from None


def codec_names() -> list[str]:
    return sorted(_BY_NAME)


def resolve_codec(codec: "str | Codec") -> Codec:
    """A codec by name, or a codec instance a caller built (the prefill side's per-request
    ranking of a mixed codec): its id must be registered under its name, so readers can decode it."""
    if not isinstance(codec, Codec):
        return get_codec(codec)
    if codec_by_id(codec.codec_id).name != codec.name:
        raise ValueError(f"codec {codec.name!r} has id {codec.codec_id}, registered as {codec_by_id(codec.codec_id).name!r}")
    return codec


register(RawCodec())
register(Lz4PlanesCodec())
register(Int8Codec())
register(Int4Codec())
register(MixedPrecisionCodec(0.50, "mixed50", 4))
register(MixedPrecisionCodec(0.75, "mixed75", 5))
register(MixedPrecisionCodec(0.25, "mixed25", 6))  # fp32 KV (int4/int8 rows); below int4 for 16-bit KV
if set(_BY_NAME) != set(BUILTIN_CODECS):  # kvstore.config checks names against that list
    raise ImportError(f"kvstore.config.BUILTIN_CODECS {BUILTIN_CODECS} differs from the codecs registered here")

__all__ = ["Codec", "register", "get_codec", "codec_by_id", "codec_names", "resolve_codec"]
