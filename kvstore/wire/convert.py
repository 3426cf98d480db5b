"""Conversions between the wire messages and the core types, shared by daemon and client."""

from __future__ import annotations

from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.keys import HASH_BYTES, ChunkKey, Namespace
from kvstore.wire.stats import StoreStats, TierStats

_NS_FIELDS = ("model_id", "num_layers", "num_kv_heads", "head_dim", "dtype", "chunk_tokens",
              "layout", "tp_rank", "tp_size", "tenant")


def split_host_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` -> (host, port); raises ValueError."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"address {address!r} must be HOST:PORT")
    return host.strip("[]"), int(port)


def ns_to_proto(ns: Namespace) -> pb.NamespaceSpec:
    return pb.NamespaceSpec(**{f: getattr(ns, f) for f in _NS_FIELDS})


def ns_from_proto(spec: pb.NamespaceSpec) -> Namespace:
    """The namespace a request names; raises ValueError if it is not a valid one."""
    if not spec.model_id:
        raise ValueError("request carries no namespace (model_id is empty)")
    return Namespace(**{f: getattr(spec, f) for f in _NS_FIELDS})


def keys_from_proto(ns: Namespace, hashes) -> list[ChunkKey]:
    keys = []
    for i, h in enumerate(hashes):
        if len(h) != HASH_BYTES:
            raise ValueError(f"prefix_hashes[{i}] is {len(h)} bytes, expected {HASH_BYTES}")
        keys.append(ChunkKey(ns, h))
    return keys


def stats_to_proto(s: StoreStats, **extra) -> pb.StatsReply:
    tiers = [pb.TierStats(**t.__dict__) for t in s.tiers.values()]
    scalars = {k: v for k, v in s.__dict__.items() if k != "tiers"}
    return pb.StatsReply(tiers=tiers, **scalars, **extra)


def stats_from_proto(r: pb.StatsReply) -> StoreStats:
    tiers = {t.name: TierStats(**{f: getattr(t, f) for f in TierStats.__dataclass_fields__}) for t in r.tiers}
    scalars = {f: getattr(r, f) for f in StoreStats.__dataclass_fields__ if f != "tiers"}
    return StoreStats(tiers=tiers, **scalars)
