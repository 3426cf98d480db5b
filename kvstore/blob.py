"""The blob format: one chunk as stored in any tier, a 128-byte header then the payload.

Byte layout of the header (little-endian):

| offset | size | field |
|---:|---:|---|
| 0 | 4 | magic ``b"KVCB"`` |
| 4 | 2 | format version (1 or 2: how the payload checksum is computed) |
| 6 | 2 | header length in bytes (128) |
| 8 | 2 | codec id (see ``kvstore.codecs``; 0 = raw) |
| 10 | 1 | dtype code: 1 float16, 2 bfloat16, 3 float32 |
| 11 | 1 | number of dimensions (1..8) |
| 12 | 4 | reserved, zero |
| 16 | 16 | namespace fingerprint |
| 32 | 16 | prefix hash |
| 48 | 32 | shape: 8 x uint32, unused dimensions zero |
| 80 | 8 | payload length in bytes |
| 88 | 8 | payload checksum (version 2: XXH3-64 of the payload's leaf checksums; 1: XXH3-64 of the payload) |
| 96 | 24 | reserved, zero |
| 120 | 8 | header checksum: XXH3-64 of bytes 0..119 |

Version 2's payload checksum is a tree of one level: the payload is cut into leaves of
``LEAF_BYTES`` (256 KiB; the last may be shorter), each leaf's XXH3-64 is a little-endian
uint64, and the checksum is the XXH3-64 of those leaf checksums in order (of zero bytes for an
empty payload). Leaves can be hashed in any order and on any thread, so the threads that copy
a payload hash the slices they have just copied, while those are in cache: with one
sequential hash, one core's hashing speed capped every put. Version 1 blobs (one sequential
XXH3-64) are still read and verified; ``StoreConfig.blob_version`` and
``ClientOptions.blob_version`` choose what is written (1 while a shared tier still has
readers that only know version 1: they would take a version 2 blob for a corrupt one).

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
FLAT_VERSION = 1  # the payload checksum is one XXH3-64 of the payload
TREE_VERSION = 2  # the payload checksum is the XXH3-64 of the payload's leaf checksums
VERSIONS = (FLAT_VERSION, TREE_VERSION)
VERSION = TREE_VERSION  # what is written unless the configuration says otherwise
LEAF_BYTES = 256 << 10
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
    version: int = VERSION  # how ``payload_checksum`` is computed

    @property
    def dtype(self) -> torch.dtype:
        return _torch_dtypes()["DTYPES_BY_CODE"][self.dtype_code]

    @property
    def key_id(self) -> bytes:
        return self.namespace_fp + self.prefix_hash

    @property
    def blob_len(self) -> int:
        return HEADER_BYTES + self.payload_len


def payload_checksum(payload, version: int = VERSION) -> int:
    """The payload checksum of format ``version`` (one buffer)."""
    digest = payload_digest(version)
    digest.update(payload)
    return digest.intdigest()


class FlatDigest:
    """A version 1 payload checksum, fed the payload's bytes in order."""

    version = FLAT_VERSION
    leaf_bytes = 0  # no leaves: only in order, on one thread

    def __init__(self) -> None:
        self._hash = xxhash.xxh3_64()

    def update(self, data) -> None:
        self._hash.update(data)

    def intdigest(self) -> int:
        return self._hash.intdigest()


class TreeDigest:
    """A version 2 payload checksum: fed the payload's bytes in order (``update``), or whole
    leaves' checksums computed elsewhere (``extend``, with ``leaf_checksum``), or both in turn
    as long as each ``extend`` starts at a leaf boundary."""

    version = TREE_VERSION
    leaf_bytes = LEAF_BYTES

    def __init__(self) -> None:
        self._leaves: list[int] = []
        self._open = xxhash.xxh3_64()  # the leaf being fed
        self._open_bytes = 0

    @staticmethod
    def leaf_checksum(pieces: Sequence) -> int:
        """The checksum of one leaf whose bytes are ``pieces`` in order (any thread)."""
        if len(pieces) == 1:
            return xxhash.xxh3_64_intdigest(pieces[0])
        digest = xxhash.xxh3_64()
        for piece in pieces:
            digest.update(piece)
        return digest.intdigest()

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(LEAF_BYTES - self._open_bytes, len(view))
            self._open.update(view[:take])
            self._open_bytes += take
            view = view[take:]
            if self._open_bytes == LEAF_BYTES:
                self._leaves.append(self._open.intdigest())
                self._open.reset()
                self._open_bytes = 0

    def extend(self, leaf_checksums: Sequence[int]) -> None:
        """The next leaves' checksums, in order (the payload's last leaf may be short)."""
        if self._open_bytes:
            raise ValueError("extend() must start at a leaf boundary")
        self._leaves.extend(leaf_checksums)

    def intdigest(self) -> int:
        leaves = self._leaves + ([self._open.intdigest()] if self._open_bytes else [])
        return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(leaves)}Q", *leaves))


def payload_digest(version: int = VERSION) -> FlatDigest | TreeDigest:
    """A running payload checksum of format ``version``: ``update`` it with the payload's
    bytes in order, slice by slice; its ``intdigest()`` equals ``payload_checksum``."""
    if version == TREE_VERSION:
        return TreeDigest()
    if version == FLAT_VERSION:
        return FlatDigest()
    raise ValueError(f"blob format version must be one of {VERSIONS}, got {version}")


def payload_matches(header: BlobHeader, digest, payload) -> bool:
    """Whether the payload a reader fed to ``digest`` (chosen before the header was known)
    has ``header``'s checksum; a digest of another version than the header's is not
    comparable, so the payload (one buffer, or several in order) is hashed again."""
    if digest.version != header.version:
        digest = payload_digest(header.version)
        for part in [payload] if not isinstance(payload, (list, tuple)) else payload:
            digest.update(part)
    return digest.intdigest() == header.payload_checksum


def encode_header(key: ChunkKey, codec_id: int, dtype: torch.dtype, shape, payload, version: int = VERSION) -> bytes:
    """The 128-byte header for ``payload``; the blob is header + payload."""
    return _pack_header(key.namespace.fingerprint, key.prefix_hash, codec_id, dtype, shape, payload, version)[0]


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
    def pack(cls, key: ChunkKey, codec_id: int, dtype: torch.dtype, shape, payload,
             version: int = VERSION) -> "SealedBlob":
        """The blob of an encoded payload, its header packed (and known) here."""
        head, header = _pack_header(key.namespace.fingerprint, key.prefix_hash, codec_id, dtype, shape, payload,
                                    version)
        return cls([head, payload], header)

    def write_to(self, tier, key: bytes) -> None:
        tier.write(key, self.parts)


class UnsealedBlob:
    """A blob whose header is packed only once its payload's checksum is known, so that the
    tier that copies the payload in computes the checksum on the bytes as it copies them (one
    pass over the payload, not two): see ``Tier.write_sealed``."""

    def __init__(self, key: ChunkKey, codec_id: int, dtype: torch.dtype, shape, payload,
                 version: int = VERSION) -> None:
        self.key, self.codec_id, self.dtype, self.shape = key, codec_id, dtype, tuple(shape)
        self.payload, self.version = payload, version
        self.size = HEADER_BYTES + memoryview(payload).nbytes
        self.digest = payload_digest(version)
        self.header: BlobHeader | None = None  # known once sealed

    def restart(self):
        """A fresh digest for one write attempt (a failed one may have seen some bytes)."""
        self.digest = payload_digest(self.version)
        return self.digest

    def seal(self) -> bytes:
        """The header, for the checksum ``digest`` has seen (every payload byte, in order)."""
        packed, self.header = _pack_header(self.key.namespace.fingerprint, self.key.prefix_hash, self.codec_id,
                                           self.dtype, self.shape, self.payload, self.version,
                                           checksum=self.digest.intdigest())
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
        digest = payload_digest(self.header.version)
        payload = self.payload if tier.hashes_its_copy else bytes(memoryview(self.payload).cast("B"))

        def seal() -> bytes:
            if digest.intdigest() != self.header.payload_checksum:
                raise PayloadChecksumMismatch("payload checksum mismatch")
            return self.head

        tier.write_sealed(key, HEADER_BYTES, payload, digest, seal)


def reencoded_header(header: BlobHeader, codec_id: int, payload, checksum: int | None = None) -> bytes:
    """The header of the same chunk as ``header`` names, re-encoded into ``payload`` (whose
    checksum, of ``header``'s format version, is ``checksum`` where the caller knows it, else
    computed here)."""
    return _pack_header(header.namespace_fp, header.prefix_hash, codec_id, header.dtype, header.shape, payload,
                        header.version, checksum)[0]


def _pack_header(namespace_fp: bytes, prefix_hash: bytes, codec_id: int, dtype: torch.dtype, shape, payload,
                 version: int, checksum: int | None = None) -> tuple[bytes, BlobHeader]:
    """The packed header and the same header as a ``BlobHeader`` (no need to decode it back)."""
    codes = _torch_dtypes()["DTYPE_CODES"]
    if dtype not in codes:
        raise ValueError(f"unsupported dtype {dtype}; expected one of {list(DTYPE_NAMES_BY_CODE.values())}")
    shape = tuple(int(d) for d in shape)
    if not 1 <= len(shape) <= MAX_DIMS or any(d <= 0 or d >= 2**32 for d in shape):
        raise ValueError(f"shape {shape} must have 1..{MAX_DIMS} positive dimensions")
    if version not in VERSIONS:
        raise ValueError(f"blob format version must be one of {VERSIONS}, got {version}")
    dims = shape + (0,) * (MAX_DIMS - len(shape))
    header = BlobHeader(codec_id, codes[dtype], shape, namespace_fp, prefix_hash, memoryview(payload).nbytes,
                        payload_checksum(payload, version) if checksum is None else checksum, version)
    fixed = _FIXED.pack(MAGIC, version, HEADER_BYTES, codec_id, header.dtype_code, len(shape), 0, namespace_fp,
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
    if version not in VERSIONS or header_len != HEADER_BYTES:
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
        version=version,
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
    if check_payload and payload_checksum(payload, header.version) != header.payload_checksum:
        raise PayloadChecksumMismatch("payload checksum mismatch")
    return header, payload

