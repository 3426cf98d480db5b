"""The blob format: one chunk as stored in any tier, a 128-byte header then the payload.

Byte layout of the header (little-endian):

| offset | size | field |
|---:|---:|---|
| 0 | 4 | magic ``b"KVCB"`` |
| 4 | 2 | format version (1) |
| 6 | 2 | header length in bytes (128) |
| 8 | 2 | codec id (see ``kvstore.codecs``; 0 = raw) |
| 10 | 1 | dtype code: 1 float16, 2 bfloat16, 3 float32 |
| 11 | 1 | number of dimensions (1..8) |
| 12 | 4 | reserved, zero |
| 16 | 16 | namespace fingerprint |
| 32 | 16 | prefix hash |
| 48 | 32 | shape: 8 x uint32, unused dimensions zero |
| 80 | 8 | payload length in bytes |
| 88 | 8 | payload checksum: XXH3-64 of the payload |
| 96 | 24 | reserved, zero |
| 120 | 8 | header checksum: XXH3-64 of bytes 0..119 |

The payload follows at offset 128 (so it stays 64-byte aligned in aligned buffers). Decoding
checks the magic, version, header checksum, length and, unless told not to, the payload
checksum; any mismatch raises a ``CorruptBlob`` subclass, so a bad blob is never used.

torch is imported only when a header's dtype is asked for (or a header is packed): verifying
blobs needs none of it, and ``kvstore fsck`` would otherwise spend seconds loading it.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import xxhash

from kvstore.keys import ChunkKey

if TYPE_CHECKING:
    import torch

MAGIC = b"KVCB"
VERSION = 1
HEADER_BYTES = 128
MAX_DIMS = 8

_FIXED = struct.Struct("<4sHHHBBI16s16s8IQQ24x")
_CHECK = struct.Struct("<Q")
assert _FIXED.size == 120 and _FIXED.size + _CHECK.size == HEADER_BYTES

DTYPE_NAMES_BY_CODE = {1: "float16", 2: "bfloat16", 3: "float32"}  # torch's names


@functools.cache
def _torch_dtypes() -> dict[str, dict]:
    import torch

    by_code = {code: getattr(torch, name) for code, name in DTYPE_NAMES_BY_CODE.items()}
    return {"DTYPES_BY_CODE": by_code, "DTYPE_CODES": {d: c for c, d in by_code.items()},
            "DTYPE_NAMES": {d: DTYPE_NAMES_BY_CODE[c] for c, d in by_code.items()}}


def __getattr__(name: str):
    """``DTYPE_CODES`` (torch dtype -> code), ``DTYPES_BY_CODE`` and ``DTYPE_NAMES`` (torch
    dtype -> name), built on first use: they need torch."""
    if name not in ("DTYPE_CODES", "DTYPES_BY_CODE", "DTYPE_NAMES"):  # e.g. ``__path__``, asked by every import
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _torch_dtypes()[name]


class CorruptBlob(Exception):
    """A blob failed verification; it must be dropped, never used."""


class BadMagic(CorruptBlob):
    pass


class UnsupportedVersion(CorruptBlob):
    pass


class HeaderChecksumMismatch(CorruptBlob):
    pass


class PayloadChecksumMismatch(CorruptBlob):
    pass


class TruncatedBlob(CorruptBlob):
    pass


class KeyMismatch(CorruptBlob):
    """The blob is intact but names another key than the one it was stored under."""


@dataclass(frozen=True)
class BlobHeader:
    codec_id: int
    dtype_code: int  # DTYPE_NAMES_BY_CODE
    shape: tuple[int, ...]
    namespace_fp: bytes
    prefix_hash: bytes
    payload_len: int
    payload_checksum: int

    @property
    def dtype(self) -> torch.dtype:
        return _torch_dtypes()["DTYPES_BY_CODE"][self.dtype_code]

    @property
    def key_id(self) -> bytes:
        return self.namespace_fp + self.prefix_hash

    @property
    def blob_len(self) -> int:
        return HEADER_BYTES + self.payload_len


def payload_checksum(payload) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def payload_digest():
    """A running payload checksum: ``update`` it with the payload's bytes in order, slice by
    slice; its ``intdigest()`` equals ``payload_checksum`` of the whole."""
    return xxhash.xxh3_64()


def encode_header(key: ChunkKey, codec_id: int, dtype: torch.dtype, shape, payload) -> bytes:
    """The 128-byte header for ``payload``; the blob is header + payload."""
    return _pack_header(key.namespace.fingerprint, key.prefix_hash, codec_id, dtype, shape, payload)[0]


class _HeaderKnown:
    """A blob whose header is known before it is written: its dtype and shape are the header's."""

    header: BlobHeader

    @property
    def dtype(self) -> torch.dtype:
        return self.header.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.header.shape


class SealedBlob(_HeaderKnown):
    """A whole blob (header and payload, possibly in pieces) with its header parsed once:
    a put carries it from the caller to the first tier and the index, and nobody along the
    way decodes the header again."""

    def __init__(self, parts: Sequence, header: BlobHeader) -> None:
        self.parts, self.header = parts, header
        self.size = sum(memoryview(p).nbytes for p in parts)

    @classmethod
    def parse(cls, parts: Sequence) -> "SealedBlob":
        """A blob whose header is read from its leading bytes (verified; not the payload)."""
        head = bytearray()
        for part in parts:
            head += memoryview(part).cast("B")[: HEADER_BYTES - len(head)]
            if len(head) == HEADER_BYTES:
                break
        return cls(parts, decode_header(head))

    @classmethod
    def pack(cls, key: ChunkKey, codec_id: int, dtype: torch.dtype, shape, payload) -> "SealedBlob":
        """The blob of an encoded payload, its header packed (and known) here."""
        head, header = _pack_header(key.namespace.fingerprint, key.prefix_hash, codec_id, dtype, shape, payload)
        return cls([head, payload], header)

    def write_to(self, tier, key: bytes) -> None:
        tier.write(key, self.parts)


class UnsealedBlob:
    """A blob whose header is packed only once its payload's checksum is known, so that the
    tier that copies the payload in computes the checksum on the bytes as it copies them (one
    pass over the payload, not two): see ``Tier.write_sealed``."""

    def __init__(self, key: ChunkKey, codec_id: int, dtype: torch.dtype, shape, payload) -> None:
        self.key, self.codec_id, self.dtype, self.shape = key, codec_id, dtype, tuple(shape)
        self.payload = payload
        self.size = HEADER_BYTES + memoryview(payload).nbytes
        self.digest = payload_digest()
        self.header: BlobHeader | None = None  # known once sealed

    def restart(self):
        """A fresh digest for one write attempt (a failed one may have seen some bytes)."""
        self.digest = payload_digest()
        return self.digest

    def seal(self) -> bytes:
        """The header, for the checksum ``digest`` has seen (every payload byte, in order)."""
        packed, self.header = _pack_header(self.key.namespace.fingerprint, self.key.prefix_hash, self.codec_id,
                                           self.dtype, self.shape, self.payload, checksum=self.digest.intdigest())
        return packed

    def write_to(self, tier, key: bytes) -> None:
        """Into ``tier``, which checksums the payload as it copies it in and then seals it."""
        tier.write_sealed(key, HEADER_BYTES, self.payload, self.restart(), self.seal)


class ClaimedBlob(_HeaderKnown):
    """A blob whose header is verified but whose payload is only claimed to match it (a
    client's, in memory the client may still write): the tier that copies the payload in
    checksums the copy (``Tier.write_sealed``), and nothing is stored unless that checksum is
    the header's (PayloadChecksumMismatch). What is checked is what is stored, in one pass
    over the payload, not a verifying pass and a copying one."""

    def __init__(self, head: bytes, header: BlobHeader, payload) -> None:
        """``head``: the header's bytes as they are to be stored; ``header``: what they say."""
        self.head, self.header, self.payload = head, header, payload
        self.size = HEADER_BYTES + memoryview(payload).nbytes

    def write_to(self, tier, key: bytes) -> None:
        """Into ``tier``, checked on the way; a tier that hashes the source, not its own copy,
        gets a private copy of the payload first (the sender could change it in between)."""
        digest = payload_digest()
        payload = self.payload if tier.hashes_its_copy else bytes(memoryview(self.payload).cast("B"))

        def seal() -> bytes:
            if digest.intdigest() != self.header.payload_checksum:
                raise PayloadChecksumMismatch("payload checksum mismatch")
            return self.head

        tier.write_sealed(key, HEADER_BYTES, payload, digest, seal)


def reencoded_header(header: BlobHeader, codec_id: int, payload, checksum: int | None = None) -> bytes:
    """The header of the same chunk as ``header`` names, re-encoded into ``payload`` (whose
    checksum is ``checksum`` where the caller knows it, else computed here)."""
    return _pack_header(header.namespace_fp, header.prefix_hash, codec_id, header.dtype, header.shape, payload,
                        checksum)[0]


def _pack_header(namespace_fp: bytes, prefix_hash: bytes, codec_id: int, dtype: torch.dtype, shape, payload,
                 checksum: int | None = None) -> tuple[bytes, BlobHeader]:
    """The packed header and the same header as a ``BlobHeader`` (no need to decode it back)."""
    codes = _torch_dtypes()["DTYPE_CODES"]
    if dtype not in codes:
        raise ValueError(f"unsupported dtype {dtype}; expected one of {list(DTYPE_NAMES_BY_CODE.values())}")
    shape = tuple(int(d) for d in shape)
    if not 1 <= len(shape) <= MAX_DIMS or any(d <= 0 or d >= 2**32 for d in shape):
        raise ValueError(f"shape {shape} must have 1..{MAX_DIMS} positive dimensions")
    dims = shape + (0,) * (MAX_DIMS - len(shape))
    header = BlobHeader(codec_id, codes[dtype], shape, namespace_fp, prefix_hash, memoryview(payload).nbytes,
                        payload_checksum(payload) if checksum is None else checksum)
    fixed = _FIXED.pack(MAGIC, VERSION, HEADER_BYTES, codec_id, header.dtype_code, len(shape), 0, namespace_fp,
                        prefix_hash, *dims, header.payload_len, header.payload_checksum)
    return fixed + _CHECK.pack(xxhash.xxh3_64_intdigest(fixed)), header


def decode_header(data) -> BlobHeader:
    """Parse and verify the header at the start of ``data`` (any buffer)."""
    view = memoryview(data)
    if len(view) < HEADER_BYTES:
        raise TruncatedBlob(f"blob is {len(view)} bytes, shorter than its {HEADER_BYTES}-byte header")
    if bytes(view[:4]) != MAGIC:
        raise BadMagic(f"bad magic {bytes(view[:4])!r}")
    fixed = view[: _FIXED.size]
    (stored,) = _CHECK.unpack_from(view, _FIXED.size)
    if xxhash.xxh3_64_intdigest(fixed) != stored:
        raise HeaderChecksumMismatch("header checksum mismatch")
    (_, version, header_len, codec_id, dtype_code, ndim, _, ns, ph, *rest) = _FIXED.unpack(fixed)
    dims, payload_len, checksum = rest[:MAX_DIMS], rest[MAX_DIMS], rest[MAX_DIMS + 1]
    if version != VERSION or header_len != HEADER_BYTES:
        raise UnsupportedVersion(f"blob format version {version} (header {header_len} B) is not supported")
    if dtype_code not in DTYPE_NAMES_BY_CODE or not 1 <= ndim <= MAX_DIMS:
        raise CorruptBlob(f"bad dtype code {dtype_code} or ndim {ndim}")
    return BlobHeader(
        codec_id=codec_id,
        dtype_code=dtype_code,
        shape=tuple(dims[:ndim]),
        namespace_fp=ns,
        prefix_hash=ph,
        payload_len=payload_len,
        payload_checksum=checksum,
    )


def verify_blob_header(head, blob_len: int, key: ChunkKey | None = None) -> BlobHeader:
    """The verified header at the start of ``head`` of a ``blob_len``-byte blob of ``key``."""
    header = decode_header(head)
    if blob_len != header.blob_len:
        raise TruncatedBlob(f"blob is {blob_len} bytes, header says {header.blob_len}")
    if key is not None and header.key_id != key.id:
        raise KeyMismatch(f"blob holds key {header.key_id.hex()}, expected {key.id.hex()}")
    return header


def verify_blob(data, key: ChunkKey | None = None, check_payload: bool = True) -> tuple[BlobHeader, memoryview]:
    """Verify a whole blob and return its header and a view of its payload."""
    view = memoryview(data)
    header = verify_blob_header(view, len(view), key)
    payload = view[HEADER_BYTES:]
    if check_payload and payload_checksum(payload) != header.payload_checksum:
        raise PayloadChecksumMismatch("payload checksum mismatch")
    return header, payload

