"""Chunk keys: a namespace fingerprint plus a prefix hash chained over token ids.

The hash must be identical in every process and on every host, so it is BLAKE2b over a
canonical byte encoding, never Python's salted ``hash``. The engine's prefix cache uses
the same ``chain_hash`` for its blocks, so one store chunk is exactly
``chunk_tokens / block_size`` engine blocks.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import xxhash

HASH_BYTES = 16
KEY_BYTES = 2 * HASH_BYTES
ROOT_HASH = hashlib.blake2b(b"kvstore/prefix-root/v1", digest_size=HASH_BYTES).digest()

# dtype names a namespace accepts (bytes per element); the blob format maps them to one-byte codes.
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
DTYPES = tuple(DTYPE_BYTES)


def chain_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Hash of a block of tokens given the hash of everything before it."""
    if len(parent) != HASH_BYTES:
        raise ValueError(f"parent hash must be {HASH_BYTES} bytes, got {len(parent)}")
    tokens = np.asarray(token_ids, dtype=np.int64)
    if tokens.ndim != 1:
        raise ValueError("token_ids must be a flat sequence")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**32):
        raise ValueError("token ids must be in [0, 2**32)")
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    h.update(tokens.astype("<u4").tobytes())
    return h.digest()


@dataclass(frozen=True)
class Namespace:
    """Everything that makes KV of one deployment incompatible with another's.

    Two namespaces share chunks only when every field is equal; ``tenant`` is a salt that
    keeps users apart even for identical tokens.
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    chunk_tokens: int = 256
    layout: str = "LKTHD"
    tp_rank: int = 0
    tp_size: int = 1
    tenant: str = ""
    fingerprint: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("model_id must not be empty")
        # The fingerprint joins the fields with "\x1f"; every field but model_id and tenant is a
        # number or a checked name, and tenant is the last, so a model_id free of "\x1f" keeps
        # the encoding unambiguous (with one, "m\x1f..." + tenant "t" read as model "m" + a
        # longer tenant: two namespaces, one fingerprint). Tenants may hold it (session salts).
        if "\x1f" in self.model_id:
            raise ValueError("model_id must not contain the unit separator \\x1f")
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_tokens", "tp_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} out of range for tp_size {self.tp_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.layout != "LKTHD":
            raise ValueError(f"unsupported KV layout {self.layout!r} (only 'LKTHD')")
        canonical = "\x1f".join(
            str(v)
            for v in (
                "kvstore-ns-v1", self.model_id, self.num_layers, self.num_kv_heads,
                self.head_dim, self.dtype, self.chunk_tokens, self.layout,
                self.tp_rank, self.tp_size, self.tenant,
            )
        )
        digest = hashlib.blake2b(canonical.encode(), digest_size=HASH_BYTES).digest()
        object.__setattr__(self, "fingerprint", digest)

    @property
    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        """Logical shape of one chunk: [layers, K/V, tokens, kv_heads, head_dim]."""
        return (self.num_layers, 2, self.chunk_tokens, self.num_kv_heads, self.head_dim)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one raw chunk."""
        return math.prod(self.chunk_shape) * DTYPE_BYTES[self.dtype]

    @property
    def torch_dtype(self):
        import torch  # here, not at import: a client that moves only bytes need not load torch

        return getattr(torch, self.dtype)

    def check(self, tensor, what: str = "chunk") -> None:
        """Raise unless ``tensor`` is a torch tensor of this namespace's chunk dtype and shape."""
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != self.torch_dtype:
            raise ValueError(f"{what} dtype {tensor.dtype} does not match namespace dtype {self.dtype}")
        if tuple(tensor.shape) != self.chunk_shape:
            raise ValueError(f"{what} shape {tuple(tensor.shape)} does not match namespace chunk shape {self.chunk_shape}")


@dataclass(frozen=True)
class ChunkKey:
    """Names one chunk: the namespace it belongs to and the hash of its whole prefix."""

    namespace: Namespace
    prefix_hash: bytes

    def __post_init__(self) -> None:
        if len(self.prefix_hash) != HASH_BYTES:
            raise ValueError(f"prefix_hash must be {HASH_BYTES} bytes, got {len(self.prefix_hash)}")

    @property
    def id(self) -> bytes:
        """The 32 bytes tiers store the chunk under: namespace fingerprint + prefix hash."""
        return self.namespace.fingerprint + self.prefix_hash

    def __repr__(self) -> str:
        return f"ChunkKey({self.namespace.model_id}, {self.prefix_hash.hex()[:12]}…)"


def prefix_hashes(token_ids: Sequence[int], block_tokens: int, parent: bytes = ROOT_HASH) -> list[bytes]:
    """Chained hashes of every *full* block of ``block_tokens`` tokens."""
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    tokens = np.asarray(token_ids, dtype=np.int64)
    hashes = []
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        parent = chain_hash(parent, tokens[start : start + block_tokens])
        hashes.append(parent)
    return hashes


def chunk_keys(token_ids: Sequence[int], namespace: Namespace) -> list[ChunkKey]:
    """One key per full chunk of ``token_ids``; a partial last chunk gets none."""
    return [ChunkKey(namespace, h) for h in prefix_hashes(token_ids, namespace.chunk_tokens)]


def weights_fingerprint(path: str | Path) -> str:
    """A short name for the weights at ``path`` (a weights file, or a folder of safetensors
    with its config.json): the file or folder name plus a digest of every weight file's name,
    size and whole content. Two checkpoints that differ anywhere (another quantisation,
    another random seed, a fine-tune of a few middle layers) get different names, so their KV
    never mixes in a store; the engine and the vLLM connector both name models by it. The
    content goes through XXH3-128, which runs at memory speed: a load reads every byte anyway."""
    p = Path(path)
    files = [p] if p.is_file() else sorted([*p.glob("*.safetensors"), p / "config.json"])
    digest = hashlib.blake2b(digest_size=8)
    for f in files:
        size = f.stat().st_size
        digest.update(f"{f.name}:{size}".encode())
        content = xxhash.xxh3_128()
        with open(f, "rb") as fh:
            while block := fh.read(8 << 20):
                content.update(block)
        digest.update(content.digest())
    return f"{p.name}-{digest.hexdigest()}"
