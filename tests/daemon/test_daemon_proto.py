"""The committed stubs are what the .proto generates, and the contract carries what it must."""

from pathlib import Path

import pytest

from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.wire._proto.regen import GENERATED, ROOT, generate
from kvstore.wire.convert import ns_from_proto, ns_to_proto
from kvstore.keys import Namespace


def test_committed_stubs_are_up_to_date(tmp_path):
    pytest.importorskip("grpc_tools")
    fresh = generate(tmp_path)
    for path in fresh:
        committed = ROOT / "kvstore" / "wire" / "_proto" / path.name
        assert path.read_bytes() == committed.read_bytes(), f"{committed} is stale: run python -m kvstore.wire._proto.regen"
    assert sorted(p.name for p in fresh) == sorted(GENERATED)


def test_every_request_names_its_namespace_in_full():
    ns = Namespace("m", 3, 2, 64, "bfloat16", 128, tp_rank=1, tp_size=2, tenant="t")
    assert ns_from_proto(ns_to_proto(ns)).fingerprint == ns.fingerprint
    names = {f.name for f in pb.NamespaceSpec.DESCRIPTOR.fields}
    assert names == {"model_id", "num_layers", "num_kv_heads", "head_dim", "dtype", "chunk_tokens", "layout",
                     "tp_rank", "tp_size", "tenant"}
    for msg in (pb.PutHeader, pb.GetRequest, pb.KeysRequest, pb.PinRequest, pb.PrefetchRequest, pb.PauseRequest):
        assert msg.DESCRIPTOR.fields_by_name["namespace"].message_type is pb.NamespaceSpec.DESCRIPTOR


def test_the_service_has_the_stores_operations():
    methods = {m.name: m for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods}
    assert {"Put", "Get", "Lookup", "Contains", "Prefetch", "Pin", "Unpin", "Delete", "Stats"} <= set(methods)
    assert methods["Put"].client_streaming and methods["Get"].server_streaming
    assert Path(ROOT / "proto" / "kvstore.proto").exists()


def test_stats_cross_the_wire_whole():
    """Every StoreStats and TierStats field, placement's counters included, survives the proto."""
    from dataclasses import fields

    from kvstore.wire.convert import stats_from_proto, stats_to_proto
    from kvstore.wire.stats import StoreStats, TierStats

    tier = TierStats(**{f.name: (7.5 if f.type in (float, "float") else "host" if f.name == "name" else i + 1)
                        for i, f in enumerate(fields(TierStats))})
    stats = StoreStats(tiers={"host": tier}, **{f.name: i + 1 for i, f in enumerate(fields(StoreStats)) if f.name != "tiers"})
    assert stats_from_proto(stats_to_proto(stats)) == stats
