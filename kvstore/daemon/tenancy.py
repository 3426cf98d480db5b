"""Binding the namespace a request names to the caller's tenant.

The daemon builds the namespace it stores and reads under from the caller's authenticated
tenant, so a caller addresses its own tenant's chunks and nobody else's, whatever it writes
into its namespace's ``tenant``. That field gives no power: it only tells apart namespaces
within the caller's own tenant (as it does in an in-process Store), so for a caller of
tenant ``alice`` the field "" or "alice" means ``alice`` and "x" means ``alice/x`` ("alice/x"
too). Tenant names contain no "/", so no caller's namespaces are ever another's. A daemon
without tenants has one caller, and the field is its salt as it stands. The one claim that
leaves the caller's tenant is the shared tenant's name, honoured for tenants whose ``shared``
access allows the operation.

Blob headers name the key as the client computed it (with its claimed tenant). A Put's blob
is verified against that key and stored with a header naming the bound key; a blob read
back is given a header naming the client's key again. Both rewrites recompute one checksum
and happen only when the claim differs from the binding.

The namespace's dimensions are checked against the daemon's limits here, before anything
is sized by them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import grpc

from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.blob import BlobHeader, reencoded_header
from kvstore.daemon.config import LimitsConfig
from kvstore.daemon.errors import Fail
from kvstore.daemon.identity import Tenant
from kvstore.keys import DTYPES, HASH_BYTES, ChunkKey, Namespace
from kvstore.wire.convert import ns_from_proto

READ, WRITE = "read", "write"
_ELEMENT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class Bound:
    ns: Namespace  # the namespace the chunks are stored under
    claimed: Namespace  # the namespace as the client named it (its blob headers name its keys)
    owner: Tenant  # whose chunks these are: the caller's, or the shared tenant's

    @property
    def rekeyed(self) -> bool:
        return self.ns.fingerprint != self.claimed.fingerprint

    @property
    def chunk_bytes(self) -> int:
        return math.prod(self.ns.chunk_shape) * _ELEMENT_BYTES[self.ns.dtype]

    def keys(self, hashes, first: int = 0) -> list[ChunkKey]:
        """``hashes`` bound as keys; ``first`` is the index of the first in its request."""
        out = []
        for i, h in enumerate(hashes, first):
            if len(h) != HASH_BYTES:
                raise Fail(grpc.StatusCode.INVALID_ARGUMENT, f"prefix_hashes[{i}] is {len(h)} bytes, expected {HASH_BYTES}")
            out.append(ChunkKey(self.ns, h))
        return out

    def header_for(self, header: BlobHeader, payload, claimed: bool) -> bytes:
        """``header`` re-keyed to the bound key (``claimed`` False) or the client's key (the
        payload is the same: its checksum is the header's, not hashed again)."""
        ns = self.claimed if claimed else self.ns
        return reencoded_header(dataclasses.replace(header, namespace_fp=ns.fingerprint), header.codec_id, payload,
                                header.payload_checksum)


def bind(spec: pb.NamespaceSpec, caller: Tenant, access: str, shared: Tenant | None, limits: LimitsConfig) -> Bound:
    """The namespace ``spec`` names, bound to ``caller`` (or to the shared tenant, when it
    names that and ``caller`` may ``access`` it); Fail if it is not a valid one."""
    if len(spec.model_id.encode()) > limits.max_model_id_bytes or not spec.model_id.isprintable():
        raise Fail(grpc.StatusCode.INVALID_ARGUMENT,
                   f"model_id must be printable and at most {limits.max_model_id_bytes} bytes")
    if len(spec.tenant.encode()) > limits.max_model_id_bytes:
        raise Fail(grpc.StatusCode.INVALID_ARGUMENT, f"tenant must be at most {limits.max_model_id_bytes} bytes")
    if spec.dtype not in DTYPES:
        raise Fail(grpc.StatusCode.INVALID_ARGUMENT, f"dtype must be one of {DTYPES}, got {spec.dtype!r}")
    chunk_bytes = spec.num_layers * 2 * spec.chunk_tokens * spec.num_kv_heads * spec.head_dim * _ELEMENT_BYTES[spec.dtype]
    if chunk_bytes > limits.max_chunk_bytes:
        raise Fail(grpc.StatusCode.INVALID_ARGUMENT,
                   f"the namespace's chunks are {chunk_bytes} bytes; this daemon's limit is {limits.max_chunk_bytes}")
    owner, tenant = caller, _within(caller, spec.tenant)
    if shared is not None and spec.tenant == shared.name:
        if not caller.may(access):
            raise Fail(grpc.StatusCode.PERMISSION_DENIED, f"this credential may not {access} the shared tenant's chunks")
        owner, tenant = shared, shared.name
    try:
        claimed = ns_from_proto(spec)
        ns = claimed if claimed.tenant == tenant else dataclasses.replace(claimed, tenant=tenant)
    except ValueError as exc:
        raise Fail(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
    return Bound(ns, claimed, owner)


def _within(caller: Tenant, claim: str) -> str:
    """The tenant string a caller's claim stands for, inside the caller's own tenant."""
    if not caller.name:  # no tenants: one caller, whose claim is its own salt
        return claim
    if claim in ("", caller.name) or claim.startswith(caller.name + "/"):
        return claim or caller.name
    return f"{caller.name}/{claim}"
