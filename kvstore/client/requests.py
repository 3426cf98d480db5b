"""The request messages that name keys, and the namespaces this client has named in them: a
key id (namespace fingerprint + prefix hash) of one of those turns back into its ChunkKey,
so ``put_blob`` can take what a Store hands out."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.keys import HASH_BYTES, ChunkKey, Namespace
from kvstore.wire.convert import ns_to_proto

if TYPE_CHECKING:
    import torch


def one_namespace(keys: Sequence[ChunkKey]) -> Namespace | None:
    """The namespace every key of one call shares (None: no keys)."""
    if not keys:
        return None
    ns = keys[0].namespace
    if any(k.namespace != ns for k in keys):
        raise ValueError("all keys of one call must share a namespace")
    return ns


def check_tensor(ns: Namespace, tensor: torch.Tensor, what: str) -> None:
    """Refuse a tensor whose shape or dtype is not the namespace's chunk's."""
    if tuple(tensor.shape) != ns.chunk_shape or str(tensor.dtype).removeprefix("torch.") != ns.dtype:
        raise ValueError(f"{what} {tensor.dtype}{list(tensor.shape)} does not match namespace "
                         f"{ns.dtype}{list(ns.chunk_shape)}")


class Requests:
    def __init__(self) -> None:
        self._namespaces: dict[bytes, Namespace] = {}

    def namespace(self, ns: Namespace) -> pb.NamespaceSpec:
        """``ns`` as the wire names it, remembered for ``key_of``."""
        self._namespaces.setdefault(ns.fingerprint, ns)
        return ns_to_proto(ns)

    def keys_request(self, cls, keys: Sequence[ChunkKey], **kw):
        """A ``cls`` message naming ``keys`` (one namespace) and the fields ``kw``."""
        return cls(namespace=self.namespace(one_namespace(keys)), prefix_hashes=[k.prefix_hash for k in keys], **kw)

    def key_of(self, key: ChunkKey | bytes) -> ChunkKey:
        if isinstance(key, ChunkKey):
            return key
        ns = self._namespaces.get(bytes(key[:HASH_BYTES]))
        if ns is None or len(key) != 2 * HASH_BYTES:
            raise ValueError("put_blob needs a ChunkKey, or the id of a key whose namespace this client has used")
        return ChunkKey(ns, bytes(key[HASH_BYTES:]))
