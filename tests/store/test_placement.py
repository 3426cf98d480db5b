import json
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from faults import Gate
from helpers import WIDE_NS
from kvstore.blob import encode_header
from kvstore.codecs import get_codec
from kvstore.config import DiskTierConfig, HostTierConfig, PlacementConfig, StoreConfig, WriteBehindConfig
from kvstore.keys import Namespace, chunk_keys
from kvstore.store import Store
from kvstore.store.placement import Placement, load_verdicts

PAGE = 4096
SHAPE = WIDE_NS.chunk_shape
M = WIDE_NS.model_id
NS_B = Namespace("other-model", num_layers=2, num_kv_heads=2, head_dim=64, chunk_tokens=16)  # no verdict
RAW_BLOB = 128 + 16384
CHUNK_PAGES = 5  # a raw blob's footprint; an int8 one takes 3


def verdict_file(tmp_path, dtype="float16", model_id=WIDE_NS.model_id, **codecs) -> str:
    """A verdict file allowing the named codecs (name=ppl change %) for ``model_id`` in ``dtype``."""
    path = tmp_path / f"verdicts-{model_id}-{dtype}.json"
    path.write_text(json.dumps({
        "schema": "kvstore.codec-verdicts/2", "model": "test", "model_id": model_id, "dtype": dtype,
        "codecs": {name: {"ppl_change_pct": ppl, "allowed": True} for name, ppl in codecs.items()}
        | {"int4": {"ppl_change_pct": 9.0, "allowed": False}},
    }))
    return str(path)


def placement(tmp_path, **kw) -> Placement:
    kw.setdefault("verdicts", [verdict_file(tmp_path, int8=0.02)])
    kw.setdefault("quality_weight_s", 0.0005)
    kw.setdefault("prefill_tokens_per_s", 2000.0)  # recomputing a chunk: 8 ms
    p = Placement(PlacementConfig(enabled=True, **kw))
    p.profile(torch.float16, SHAPE)
    return p


def int8_bound(original: torch.Tensor) -> torch.Tensor:
    """docs/codecs.md: max|row| / 254, plus rounding to fp16 at the decoded magnitude."""
    x = original.float()
    row_max = x.abs().amax(dim=-1, keepdim=True)
    return row_max / 254 + 2**-10 * (x.abs() + row_max / 254) + 2**-14 + 2**-22 * row_max


def within_int8(got: torch.Tensor, original: torch.Tensor) -> bool:
    return bool(((got.float() - original.float()).abs() <= int8_bound(original)).all())


def chunks(n, seed=0, ns=WIDE_NS):
    gen = torch.Generator().manual_seed(seed)
    keys = chunk_keys(torch.randint(0, 50_000, (n * ns.chunk_tokens,), generator=gen).tolist(), ns)
    return keys, [torch.randn(SHAPE, generator=gen).half() for _ in keys]


def store_config(tmp_path, host_chunks, disk_chunks=None, policy="lru") -> StoreConfig:
    """Room for ``host_chunks`` (and ``disk_chunks``) raw chunks; recomputing a chunk costs 8 ms
    and a lossy use 10 us, so compressing beats dropping whenever nothing faster holds it."""
    return StoreConfig(
        host=HostTierConfig(capacity_bytes=host_chunks * CHUNK_PAGES * PAGE, page_bytes=PAGE, prefault=False),
        disk=DiskTierConfig(path=str(tmp_path / "data"), capacity_bytes=(disk_chunks or 1) * CHUNK_PAGES * PAGE,
                            enabled=disk_chunks is not None),
        write_behind=WriteBehindConfig(max_pending_bytes=host_chunks * CHUNK_PAGES * PAGE // 2),
        eviction_policy=policy,
        placement=PlacementConfig(enabled=True, codecs=["int8"], verdicts=[verdict_file(tmp_path, int8=0.02)],
                                  quality_weight_s=0.0005, prefill_tokens_per_s=2000.0),
    )


# -- the model ------------------------------------------------------------------------------


def test_only_codecs_a_verdict_allows_for_the_dtype_are_candidates(tmp_path):
    p = placement(tmp_path, codecs=["lz4", "int8", "int4"])
    assert [c.name for c in p.candidates(M, torch.float16)] == ["lz4", "int8"]  # int4 is not allowed
    assert [c.name for c in p.candidates(M, torch.bfloat16)] == ["lz4"]  # no verdict for bf16: lossless only


def test_compresses_a_victim_that_would_otherwise_be_recomputed(tmp_path):
    p = placement(tmp_path)
    choice = p.choose(M, torch.float16, SHAPE, RAW_BLOB, 1.0, p.recompute_s(SHAPE), 1e9, lambda n: n)
    assert choice is not None and choice.codec.name == "int8" and choice.footprint < RAW_BLOB


def test_drops_a_victim_a_faster_replica_serves_anyway(tmp_path):
    p = placement(tmp_path)
    assert p.choose(M, torch.float16, SHAPE, RAW_BLOB, 1.0, 1e-9, 1e9, lambda n: n) is None


def test_quality_weight_can_price_a_lossy_codec_out(tmp_path):
    p = placement(tmp_path, quality_weight_s=1.0)  # 0.02% x 1 s = 20 ms per use > 8 ms to recompute
    assert p.choose(M, torch.float16, SHAPE, RAW_BLOB, 1.0, p.recompute_s(SHAPE), 1e9, lambda n: n) is None


def test_low_reuse_is_not_worth_the_bytes(tmp_path):
    p = placement(tmp_path)
    assert p.choose(M, torch.float16, SHAPE, RAW_BLOB, 0.03, p.recompute_s(SHAPE), 1e9, lambda n: n) is None


def test_an_encoding_must_shrink_the_tiers_footprint(tmp_path):
    p = placement(tmp_path)
    def whole_units(n: int) -> int:  # raw and int8 blobs both take one 64 KiB unit
        return -(-n // 65536) * 65536

    assert p.choose(M, torch.float16, SHAPE, RAW_BLOB, 1.0, p.recompute_s(SHAPE), 1e9, whole_units) is None


def test_a_new_copy_on_a_tier_with_room_takes_the_encoding_that_saves_most_time(tmp_path):
    p = placement(tmp_path, decode_bytes_per_s=10**9)  # int8 decodes 16 KiB in 16 us
    fast, slow = 10**10, 2 * 10**6  # a raw copy loads in 1.6 us, or in 8 ms: what recomputing costs
    assert p.choose_on_write(M, torch.float16, SHAPE, RAW_BLOB, fast, lambda n: n, room=True) is None
    choice = p.choose_on_write(M, torch.float16, SHAPE, RAW_BLOB, slow, lambda n: n, room=True)
    assert choice is not None and choice.codec.name == "int8"


def test_a_new_copy_on_a_full_tier_takes_the_encoding_that_saves_most_per_byte(tmp_path):
    p = placement(tmp_path, decode_bytes_per_s=10**9)
    choice = p.choose_on_write(M, torch.float16, SHAPE, RAW_BLOB, 10**10, lambda n: n, room=False)
    assert choice is not None and choice.codec.name == "int8"
    priced_out = placement(tmp_path, decode_bytes_per_s=10**9, quality_weight_s=1.0)
    assert priced_out.choose_on_write(M, torch.float16, SHAPE, RAW_BLOB, 10**10, lambda n: n, room=False) is None


def test_where_no_copy_beats_recomputing_the_least_costly_one_is_written(tmp_path):
    """A disk at 1 MB/s loads a raw chunk in 16 ms, twice what recomputing it costs: int8's
    copy still costs more than recomputing, but half as much as raw's, and a hit is loaded."""
    p = placement(tmp_path, decode_bytes_per_s=10**9)
    for room in (True, False):
        choice = p.choose_on_write(M, torch.float16, SHAPE, RAW_BLOB, 10**6, lambda n: n, room=room)
        assert choice is not None and choice.codec.name == "int8" and choice.utility_per_byte < 0


def test_a_configured_decode_speed_replaces_the_measured_one(tmp_path):
    p = placement(tmp_path, decode_bytes_per_s=16384 * 1000)  # 16 KiB chunks: 1 ms each
    int8 = next(c for c in p.candidates(M, torch.float16) if c.name == "int8")
    assert p.load_s(torch.float16, SHAPE, 0, int8.codec_id, 1e9) == pytest.approx(1e-3)
    assert p.read_bytes_per_s("disk", 0.0) == p.config.assumed_read_bytes_per_s
    assert p.read_bytes_per_s("disk", 2.5) == 2.5e9
    assert placement(tmp_path, disk_read_bytes_per_s=10**6).read_bytes_per_s("disk", 2.5) == 1e6


def test_by_default_placement_is_on_and_does_nothing_without_a_verdict(tmp_path):
    config = PlacementConfig()
    assert config.enabled and all(not get_codec(c).lossless for c in config.codecs)
    p = Placement(config)
    p.profile(torch.float16, SHAPE)
    assert p.candidates(M, torch.float16) == []
    assert p.choose(M, torch.float16, SHAPE, RAW_BLOB, 1.0, p.recompute_s(SHAPE), 1e9, lambda n: n) is None
    assert p.choose_on_write(M, torch.float16, SHAPE, RAW_BLOB, 1e6, lambda n: n, room=True) is None
    assert p.inert and not placement(tmp_path).inert
    assert not Placement(PlacementConfig(codecs=["lz4"])).inert  # a lossless candidate needs no verdict
    with Store(StoreConfig(host=HostTierConfig(capacity_bytes=1 << 20, prefault=False),
                           disk=DiskTierConfig(enabled=False))) as store:
        assert store.placement is None


def test_a_codec_that_cannot_encode_the_shape_is_no_candidate_and_puts_still_succeed(tmp_path):
    """mixed25's budget at head_dim 64 is below what its scales take: it raises on encode.
    Profiling it used to raise out of every put of that shape."""
    p = placement(tmp_path, codecs=["mixed25", "int8"], verdicts=[verdict_file(tmp_path, mixed25=0.1, int8=0.02)])
    choice = p.choose(M, torch.float16, SHAPE, RAW_BLOB, 1.0, p.recompute_s(SHAPE), 1e9, lambda n: n)
    assert choice is not None and choice.codec.name == "int8"
    cfg = store_config(tmp_path, host_chunks=2)
    cfg.placement.codecs, cfg.placement.verdicts = ["mixed25"], [verdict_file(tmp_path, mixed25=0.1)]
    keys, values = chunks(3)
    with Store(cfg) as store:
        for key, value in zip(keys, values):
            store.put(key, value)
        out = torch.empty_like(values[-1])
        assert store.get_into(keys[-1], out) and torch.equal(out, values[-1])


def test_verdict_files_are_checked(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a kvstore.codec-verdicts/2 file"):
        load_verdicts([str(bad)])
    one = verdict_file(tmp_path, int8=0.1)
    with pytest.raises(ValueError, match="two files give verdicts for test-model in float16"):
        load_verdicts([one, one])
    assert load_verdicts([verdict_file(tmp_path, int8=-0.5)]) == {("test-model", "float16"): {"int8": 0.5}}
    for field, value, message in [("model_id", "", "names no model_id"), ("dtype", "fp16", "dtype 'fp16'")]:
        bad.write_text(json.dumps(json.loads(Path(one).read_text()) | {field: value}))
        with pytest.raises(ValueError, match=message):
            load_verdicts([str(bad)])


def test_a_verdict_file_that_names_no_model_id_is_refused_with_a_clear_error(tmp_path):
    """Schema /1 files name the model only by its file stem, which no namespace carries:
    applied, they allowed their codecs for every model of their dtype; now they are refused."""
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"schema": "kvstore.codec-verdicts/1", "model": "SmolLM2", "dtype": "float16",
                               "codecs": {"int4": {"ppl_change_pct": 0.5, "allowed": True}}}))
    with pytest.raises(ValueError) as raised:
        Placement(PlacementConfig(verdicts=[str(old)]))
    message = str(raised.value)
    assert "\n" not in message and str(old) in message and "re-run `kvbench probe-codec`" in message


def test_a_verdict_holds_only_for_the_model_it_was_measured_on(tmp_path):
    p = placement(tmp_path, codecs=["lz4", "int8"])
    assert [c.name for c in p.candidates(M, torch.float16)] == ["lz4", "int8"]
    for other in ("another-model", None):  # a model without a verdict, or a chunk of no known model
        assert [c.name for c in p.candidates(other, torch.float16)] == ["lz4"]
        assert p.choose(other, torch.float16, SHAPE, RAW_BLOB, 1.0, p.recompute_s(SHAPE), 1e9, lambda n: n) is None
        assert p.choose_on_write(other, torch.float16, SHAPE, RAW_BLOB, 10**6, lambda n: n, room=True) is None
    two = placement(tmp_path, codecs=["int8", "mixed75"], verdicts=[verdict_file(tmp_path, int8=0.02),
                                                                   verdict_file(tmp_path, model_id="b", mixed75=0.3)])
    assert [c.name for c in two.candidates(M, torch.float16)] == ["int8"]
    assert [c.name for c in two.candidates("b", torch.float16)] == ["mixed75"]
    with pytest.raises(ValueError, match="placement.codecs"):
        Placement(PlacementConfig(codecs=["zstd"]))


# -- in the Store -----------------------------------------------------------------------------


def test_host_victims_are_compressed_in_place_and_read_back_within_the_bound(tmp_path):
    keys, values = chunks(12)
    with Store(store_config(tmp_path, host_chunks=8)) as store:  # RAM only: dropping means recomputing
        for k, v in zip(keys, values):
            store.put(k, v)
        assert store.stats().tiers["host"].recodes > 0
        present = [i for i, k in enumerate(keys) if store.contains(k)]
        assert len(present) > 8  # more chunks than fit raw
        out = torch.empty(SHAPE, dtype=torch.float16)
        for i in present:
            assert store.get_into(keys[i], out)
            assert within_int8(out, values[i])
        assert store.stats().tiers["host"].lossy_hits > 0
        assert store.stats().tiers["host"].used_bytes <= store.stats().tiers["host"].capacity_bytes


def test_a_verdict_for_one_model_never_makes_another_models_chunks_lossy(tmp_path):
    """Two models share a store, chunks of one shape and dtype; the verdict is model A's. A's
    victims are kept int8, B's are dropped whole: before the fix, verdicts were keyed by
    dtype alone and B's chunks were re-encoded with A's quality figures."""
    keys_a, values_a = chunks(12, seed=1)
    keys_b, values_b = chunks(12, seed=2, ns=NS_B)
    with Store(store_config(tmp_path, host_chunks=8)) as store:  # RAM only: dropping means recomputing
        for ka, va, kb, vb in zip(keys_a, values_a, keys_b, values_b):
            store.put(ka, va)
            store.put(kb, vb)
        assert store.stats().tiers["host"].recodes > 0
        out = torch.empty(SHAPE, dtype=torch.float16)
        for key, value in zip(keys_b, values_b):
            if store.contains(key):
                assert store.get_into(key, out) and torch.equal(out, value), "model B's chunk came back lossy"
        assert any(store.contains(k) and store.get_into(k, out) and not torch.equal(out, v)
                   for k, v in zip(keys_a, values_a))  # model A's verdict still applies to A


def test_copies_written_behind_are_encoded_only_for_the_model_with_a_verdict(tmp_path):
    keys_a, values_a = chunks(4, seed=1)
    keys_b, values_b = chunks(4, seed=2, ns=NS_B)
    cfg = store_config(tmp_path, host_chunks=2, disk_chunks=64)
    cfg.placement.disk_read_bytes_per_s, cfg.placement.decode_bytes_per_s = 2_000_000, 10**9  # int8 saves time
    with Store(cfg) as store:
        for ka, va, kb, vb in zip(keys_a, values_a, keys_b, values_b):
            store.put(ka, va)
            store.put(kb, vb)
            store.flush()
        assert store.stats().tiers["disk"].recodes == 4  # model A's copies only
        for key, value in zip(keys_b, values_b):
            got = store.get([key])
            assert len(got) == 1 and torch.equal(got[0], value), "model B's chunk came back lossy"


def test_a_chunk_put_by_id_alone_stays_lossless_until_a_put_names_its_model(tmp_path):
    """``put_blob`` by key id does not say which model the chunk is of, so no verdict holds;
    by ``ChunkKey`` (as the daemon puts) it does."""
    keys, values = chunks(12)
    raw = get_codec("raw")

    def blob(key, value):
        payload = raw.encode(value)
        return [encode_header(key, raw.codec_id, value.dtype, value.shape, payload), payload]

    for by_key in (False, True):
        with Store(store_config(tmp_path, host_chunks=8)) as store:  # RAM only
            for k, v in zip(keys, values):
                store.put_blob(k if by_key else k.id, blob(k, v))
            assert (store.stats().tiers["host"].recodes > 0) == by_key


def test_disabled_placement_drops_victims(tmp_path):
    keys, values = chunks(12)
    cfg = store_config(tmp_path, host_chunks=8)
    cfg.placement.enabled = False
    with Store(cfg) as store:
        for k, v in zip(keys, values):
            store.put(k, v)
        assert sum(store.contains(k) for k in keys) == 8
        assert store.stats().tiers["host"].recodes == 0


def test_host_keeps_nothing_lossy_while_the_disk_holds_the_raw_copy(tmp_path):
    """The disk's raw copy loads faster than int8 decodes (a disk assumed at 100 GB/s). Reads
    do not promote: a slow disk read on a busy machine would rightly make the measured disk
    slower than a decode, and a promotion's victim would then be kept int8 (a flaky failure)."""
    keys, values = chunks(12)
    cfg = store_config(tmp_path, host_chunks=8, disk_chunks=64)
    cfg.placement.assumed_read_bytes_per_s = 100_000_000_000
    cfg.promote_on_read = False
    with Store(cfg) as store:
        for k, v in zip(keys, values):
            store.put(k, v)
            store.flush()
        for k, v in zip(keys, values):
            assert torch.equal(store.get([k])[0], v)
        assert {n: t.recodes for n, t in store.stats().tiers.items()} == {"host": 0, "disk": 0}


@pytest.mark.parametrize("encode_on_write", [True, False])
def test_copies_written_behind_to_a_slow_disk_are_encoded_when_that_saves_time(tmp_path, encode_on_write):
    """A disk planned at 2 MB/s loads a raw chunk in about the 8 ms recomputing takes; int8
    halves that, so its copies are written int8 while it still has room, and read back within
    the bound once host RAM has let them go. Without ``encode_on_write`` they stay raw."""
    keys, values = chunks(12)
    cfg = store_config(tmp_path, host_chunks=4, disk_chunks=64)
    cfg.placement.disk_read_bytes_per_s = 2_000_000
    cfg.placement.decode_bytes_per_s = 10**9
    cfg.placement.encode_on_write = encode_on_write
    with Store(cfg) as store:
        for k, v in zip(keys, values):
            store.put(k, v)
            store.flush()
        disk = store.stats().tiers["disk"]
        assert disk.evictions == 0
        assert disk.recodes == (12 if encode_on_write else 0)
        assert disk.used_bytes == 12 * (3 if encode_on_write else CHUNK_PAGES) * PAGE
        for k, v in zip(keys[:8], values[:8]):  # host RAM holds the last four only
            got = store.get([k])
            assert len(got) == 1 and (within_int8(got[0], v) if encode_on_write else torch.equal(got[0], v))


def test_disk_victims_are_compressed_and_promoted_as_they_are(tmp_path):
    keys, values = chunks(16)
    with Store(store_config(tmp_path, host_chunks=4, disk_chunks=8)) as store:
        for k, v in zip(keys, values):
            store.put(k, v)
            store.flush()
        assert store.stats().tiers["disk"].recodes > 0
        on_disk = [i for i, k in enumerate(keys) if store.contains(k) and "disk" in store.replicas([k])[0]]
        assert len(on_disk) > 8
        for i in on_disk:
            got = store.get([keys[i]])
            assert len(got) == 1 and within_int8(got[0], values[i])
        stats = store.stats().tiers
        assert stats["disk"].used_bytes <= stats["disk"].capacity_bytes
        assert stats["host"].used_bytes <= stats["host"].capacity_bytes


def test_a_chunk_that_cannot_be_encoded_is_evicted_as_usual(tmp_path):
    keys, values = chunks(12)
    for v in values:
        v.view(-1)[0] = float("nan")  # lossy codecs refuse NaN
    with Store(store_config(tmp_path, host_chunks=8)) as store:
        for k, v in zip(keys, values):
            store.put(k, v)
        stats = store.stats()
        assert stats.recode_failures > 0 and stats.tiers["host"].recodes == 0
        present = [i for i, k in enumerate(keys) if store.contains(k)]
        assert len(present) == 8
        for i in present:
            got = store.get([keys[i]])[0]
            assert torch.equal(got.view(torch.int16), values[i].view(torch.int16))


def test_placement_refuses_shared_tiers(tmp_path):
    cfg = store_config(tmp_path, host_chunks=8)
    cfg.placement.tiers = ["host", "pfs"]
    cfg.pfs.enabled, cfg.pfs.path = True, str(tmp_path / "pfs")
    with pytest.raises(ValueError, match="shared tiers"):
        Store(cfg)


@contextmanager
def checking_readers(store, keys, values, rounds: int, errors: list):
    """Two threads reading every key ``rounds`` times while the block runs; a chunk read
    outside int8's bound of its value goes into ``errors``."""
    def read():
        out = torch.empty(SHAPE, dtype=torch.float16)
        for _ in range(rounds):
            for i, key in enumerate(keys):
                if store.get_into(key, out) and not within_int8(out, values[i]):
                    errors.append(i)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        yield
    finally:
        for t in readers:
            t.join()


def test_concurrent_readers_see_whole_chunks_while_victims_are_re_encoded(tmp_path):
    keys, values = chunks(40)
    errors = []
    with Store(store_config(tmp_path, host_chunks=10)) as store:
        for k, v in zip(keys[:10], values[:10]):
            store.put(k, v)
        with checking_readers(store, keys, values, rounds=20, errors=errors):
            for k, v in zip(keys[10:], values[10:]):
                store.put(k, v)
        assert store.stats().tiers["host"].recodes > 0
    assert errors == []


def test_concurrent_readers_see_whole_chunks_while_copies_are_encoded_on_write(tmp_path):
    keys, values = chunks(40)
    cfg = store_config(tmp_path, host_chunks=6, disk_chunks=64)
    cfg.placement.disk_read_bytes_per_s, cfg.placement.decode_bytes_per_s = 2_000_000, 10**9
    errors = []
    with Store(cfg) as store:
        with checking_readers(store, keys, values, rounds=10, errors=errors):
            for k, v in zip(keys, values):
                store.put(k, v)
        store.flush()
        assert store.stats().tiers["disk"].recodes == 40
        assert all(store.contains(k) for k in keys)
    assert errors == []


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "get", "delete"]), st.integers(0, 23)), min_size=1, max_size=80),
       host_chunks=st.integers(4, 10), disk_chunks=st.sampled_from([None, 6, 12]),
       policy=st.sampled_from(["lru", "arc", "default"]), slow_disk=st.booleans())
def test_placement_never_exceeds_capacity_and_never_serves_a_wrong_chunk(
    tmp_path_factory, ops, host_chunks, disk_chunks, policy, slow_disk
):
    """``slow_disk``: the disk is planned at 2 MB/s, so its copies are written int8 too."""
    tmp_path = tmp_path_factory.mktemp("p")
    keys, values = chunks(24)
    cfg = store_config(tmp_path, host_chunks, disk_chunks, policy)
    if slow_disk:
        cfg.placement.disk_read_bytes_per_s, cfg.placement.decode_bytes_per_s = 2_000_000, 10**9
    with Store(cfg) as store:
        out = torch.empty(SHAPE, dtype=torch.float16)
        for op, i in ops:
            if op == "put":
                store.put(keys[i], values[i])
            elif op == "get":
                present = store.contains(keys[i])
                assert store.get_into(keys[i], out) == present  # an indexed chunk is never lost
                if present:
                    assert within_int8(out, values[i])
            else:
                store.delete([keys[i]])
                assert not store.contains(keys[i])
            for tier in store.stats().tiers.values():
                assert tier.used_bytes <= tier.capacity_bytes


def test_a_copy_that_finds_the_first_tiers_copy_corrupt_drops_it_and_writes_nothing(tmp_path):
    """A copy written behind in another encoding verifies the host RAM copy it re-encodes.
    Before the fix, a copy that failed verification was written anyway, as put, to the disk,
    and the host copy it had just found corrupt kept being served (host RAM reads check only
    headers). Now neither: the corrupt copy is dropped and the chunk is a miss."""
    keys, values = chunks(2)
    cfg = store_config(tmp_path, host_chunks=8, disk_chunks=64)
    cfg.placement.disk_read_bytes_per_s = 2_000_000  # slow: copies are written int8
    cfg.placement.decode_bytes_per_s = 10**9
    cfg.placement.encode_on_write = True
    cfg.write_behind.workers = 1
    with Store(cfg) as store:
        disk, host = store.tier("disk"), store.tier("host")
        held = Gate(keys[0].id)
        write = disk.write

        def gated_write(key, parts):
            held.pass_through(key)
            write(key, parts)

        disk.write = gated_write
        store.put(keys[0], values[0])
        assert held.entered.wait(10)  # the one copy worker is busy with chunk 0
        store.put(keys[1], values[1])
        with host.pinned(keys[1].id) as views:  # chunk 1's payload is damaged in host RAM
            views[-1][len(views[-1]) // 2] ^= 0x10
        held.open()
        assert store.flush(30)
        got = store.get([keys[1]])
        assert not got or torch.equal(got[0], values[1]), "a copy found corrupt was served"
        assert store.stats().tiers["host"].corruptions == 1
        assert not disk.contains(keys[1].id), "a copy found corrupt was written to the disk"
        assert within_int8(store.get([keys[0]])[0], values[0])  # the other chunk is untouched
