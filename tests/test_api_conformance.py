"""The ChunkStore contract (kvstore/api.py): the same scenarios against the in-process Store
and against a real daemon process through the Client, over shared memory and the remote path.
Also: a daemon client process never imports the Store, its tiers or its policies."""

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from kvstore.api import ChunkStore
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.keys import Namespace, chunk_keys
from kv_daemon import TOKEN, start_daemon

BACKENDS = ["store", "daemon-shm", "daemon-remote"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with start_daemon(tmp_path_factory.mktemp("api-daemon"), host_bytes="1MiB", page_bytes=4096) as proc:
        yield proc


@pytest.fixture(params=BACKENDS)
def chunk_store(request, tmp_path):
    """A fresh in-process Store, or a Client of the shared daemon (each test uses its own namespace)."""
    if request.param == "store":
        from kvstore.store import Store

        cfg = StoreConfig(host=HostTierConfig(capacity_bytes=1 << 20, page_bytes=4096),
                          disk=DiskTierConfig(path=str(tmp_path / "disk"), capacity_bytes=64 << 20))
        store = Store(cfg)
    else:
        from kvstore.client import Client

        daemon = request.getfixturevalue("daemon")
        store = Client(daemon.addr, token=TOKEN, transport=request.param.removeprefix("daemon-"))
    yield store
    store.close()


@pytest.fixture
def ns(request):
    """A namespace of this test alone: the daemon is shared by the module's tests."""
    return Namespace(f"api-{request.node.name}", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16",
                     chunk_tokens=16)


def chunks(ns, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    keys = chunk_keys(torch.randint(0, 50_000, (n * ns.chunk_tokens,), generator=gen).tolist(), ns)
    return keys, [torch.randn(ns.chunk_shape, generator=gen).half() for _ in keys]


def put_all(store, keys, kvs):
    for i, (k, kv) in enumerate(zip(keys, kvs)):
        store.put(k, kv, parent=keys[i - 1] if i else None)


def empty(ns, n):
    return [torch.full(ns.chunk_shape, float("nan"), dtype=torch.float16) for _ in range(n)]


def test_both_implementations_declare_the_protocol(chunk_store):
    assert isinstance(chunk_store, ChunkStore)


def test_lookup_counts_leading_present_keys(chunk_store, ns):
    keys, kvs = chunks(ns, 4)
    assert chunk_store.lookup(keys) == 0
    put_all(chunk_store, keys[:2], kvs[:2])
    chunk_store.put(keys[3], kvs[3])
    assert chunk_store.lookup(keys) == 2
    assert chunk_store.lookup(keys[3:]) == 1
    assert [chunk_store.contains(k) for k in keys] == [True, True, False, True]
    assert chunk_store.lookup([]) == 0


def test_reads_fill_caller_buffers_and_stop_at_the_first_miss(chunk_store, ns):
    keys, kvs = chunks(ns, 3)
    put_all(chunk_store, [keys[0], keys[2]], [kvs[0], kvs[2]])
    out = empty(ns, 1)[0]
    assert chunk_store.get_into(keys[2], out) and torch.equal(out, kvs[2])
    assert not chunk_store.get_into(keys[1], out)
    outs = empty(ns, 3)
    assert chunk_store.get_many_into(keys, outs) == 1
    assert torch.equal(outs[0], kvs[0])
    got = chunk_store.get(keys)
    assert len(got) == 1 and torch.equal(got[0], kvs[0])


def test_get_blob_is_verified_and_none_on_a_miss(chunk_store, ns):
    from kvstore.blob import verify_blob

    keys, kvs = chunks(ns, 2)
    chunk_store.put(keys[0], kvs[0])
    blob = chunk_store.get_blob(keys[0])
    verify_blob(blob, keys[0])
    assert chunk_store.get_blob(keys[1]) is None


def test_the_last_acknowledged_put_of_a_key_is_what_reads_return(chunk_store, ns):
    keys, kvs = chunks(ns, 1)
    chunk_store.put(keys[0], kvs[0])
    chunk_store.put(keys[0], kvs[0])  # the same blob again: an access, nothing rewritten
    assert torch.equal(chunk_store.get(keys)[0], kvs[0])
    chunk_store.put(keys[0], torch.zeros_like(kvs[0]))  # another blob of the key replaces it
    assert torch.equal(chunk_store.get(keys)[0], torch.zeros_like(kvs[0]))


@pytest.mark.parametrize("change", [{"dtype": "bfloat16"}, {"chunk_tokens": 8}, {"model_id": "other"},
                                    {"tenant": "someone-else"}])
def test_another_namespace_is_a_clean_miss(chunk_store, ns, change):
    """The same tokens under another model, dtype, chunk size or tenant name other chunks."""
    tokens = list(range(2 * ns.chunk_tokens))
    _, kvs = chunks(ns, 2)
    put_all(chunk_store, chunk_keys(tokens, ns), kvs)
    fields = {f: getattr(ns, f) for f in ("model_id", "num_layers", "num_kv_heads", "head_dim", "dtype",
                                          "chunk_tokens", "tenant")}
    foreign = chunk_keys(tokens, Namespace(**{**fields, **change}))
    assert chunk_store.lookup(foreign) == 0
    assert chunk_store.get(foreign) == []


def test_buffers_and_chunks_of_the_wrong_shape_or_dtype_are_value_errors(chunk_store, ns):
    keys, kvs = chunks(ns, 1)
    with pytest.raises(ValueError):
        chunk_store.put(keys[0], kvs[0].float())
    with pytest.raises(ValueError):
        chunk_store.put(keys[0], kvs[0][:, :, :4])
    chunk_store.put(keys[0], kvs[0])
    with pytest.raises(ValueError):
        chunk_store.get_into(keys[0], torch.empty(ns.chunk_shape, dtype=torch.float32))
    with pytest.raises(ValueError):
        chunk_store.get_many_into(keys, [])


def test_pins_count_present_chunks_and_their_lease_expires(chunk_store, ns):
    keys, kvs = chunks(ns, 3)
    put_all(chunk_store, keys[:2], kvs[:2])
    before = chunk_store.stats().pinned
    assert chunk_store.pin(keys, ttl_s=30.0) == 2
    assert chunk_store.stats().pinned == before + 2
    assert chunk_store.unpin(keys) == 2
    assert chunk_store.unpin(keys) == 0
    assert chunk_store.pin(keys[:1], ttl_s=0.2) == 1
    deadline = time.monotonic() + 10
    while chunk_store.stats().pinned > before:
        assert time.monotonic() < deadline, "a 0.2 s pin outlived its lease"
        time.sleep(0.05)
    assert chunk_store.unpin(keys[:1]) == 0


def test_pin_leading_pins_the_leading_present_chunks_and_nothing_past_a_gap(chunk_store, ns):
    """A lookup and a pin in one call (the connector's hit): the count is the lookup's, and
    exactly those chunks are pinned; through a daemon, across its pieces of 512 keys too."""
    keys, kvs = chunks(ns, 4)
    put_all(chunk_store, [keys[0], keys[1], keys[3]], [kvs[0], kvs[1], kvs[3]])
    before = chunk_store.stats().pinned
    assert chunk_store.pin_leading(keys, ttl_s=30.0) == 2
    assert chunk_store.stats().pinned == before + 2
    assert chunk_store.unpin(keys) == 2  # the chunk past the gap was not pinned
    assert chunk_store.pin_leading(keys[2:], ttl_s=30.0) == 0
    many, many_kvs = chunks(ns, 530, seed=5)
    put_all(chunk_store, many[:520], many_kvs[:520])
    assert chunk_store.pin_leading(many, ttl_s=30.0) == 520
    assert chunk_store.unpin(many) == 520


@pytest.mark.parametrize("ttl_s", [0.0, -1.0])
@pytest.mark.parametrize("verb", ["pin", "pin_leading"])
def test_a_pin_without_a_positive_lease_is_a_value_error(chunk_store, ns, ttl_s, verb):
    keys, kvs = chunks(ns, 1)
    chunk_store.put(keys[0], kvs[0])
    with pytest.raises(ValueError):
        getattr(chunk_store, verb)(keys, ttl_s=ttl_s)


def test_chunks_evicted_from_host_ram_are_read_and_prefetched_from_disk(chunk_store, ns):
    """Host RAM holds 1 MiB (256 of these one-page chunks): the ones that leave it (which,
    is the policy's choice: of one long prompt, the deepest) are served, or promoted back
    by prefetch, from the disk tier."""
    keys, kvs = chunks(ns, 400, seed=3)
    for i, (k, kv) in enumerate(zip(keys, kvs)):
        chunk_store.put(k, kv, parent=keys[i - 1] if i else None, durable=True)
    chunk_store.flush()
    assert chunk_store.lookup(keys) == 400
    host = chunk_store.stats().tiers["host"]
    assert host.chunks < 400
    futures = [f for i in range(0, 400, 50) for f in chunk_store.prefetch(keys[i:i + 50])]  # a daemon
    assert futures  # starts 64 promotions of one tenant at most: ask in turn, wherever they are
    for f in futures:
        f.result(timeout=30)
    outs = empty(ns, 400)
    assert chunk_store.get_many_into(keys, outs) == 400
    assert all(torch.equal(o, kv) for o, kv in zip(outs, kvs))


def test_delete_removes_everywhere(chunk_store, ns):
    keys, kvs = chunks(ns, 2)
    put_all(chunk_store, keys, kvs)
    assert chunk_store.delete(keys + keys) == 2
    assert chunk_store.lookup(keys) == 0
    assert chunk_store.delete(keys) == 0


def test_stats_count_puts_and_hits(chunk_store, ns):
    keys, kvs = chunks(ns, 2)
    before = chunk_store.stats()
    put_all(chunk_store, keys, kvs)
    chunk_store.get_many_into(keys, empty(ns, 2))
    after = chunk_store.stats()
    assert after.puts - before.puts == 2
    assert after.hits - before.hits == 2
    assert after.chunks >= 2 and "host" in after.tiers


def test_a_daemon_client_process_imports_neither_store_nor_tiers_nor_policies():
    script = textwrap.dedent(
        """
        import sys
        import kvstore.api, kvstore.client
        heavy = sorted(m for m in sys.modules if m == "kvstore.store" or m.startswith(("tiers", "kvstore.policies",
                       "kvstore.daemon", "kvstore.store.placement", "kvstore.store.tier_setup")))
        print(",".join(heavy))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
