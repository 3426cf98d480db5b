"""Tenants are credentials, not claims: a daemon with a tenants file, clients of three tenants,
and one of them trying every RPC, on every path, against another's keys. Plus the shared
tenant, bounded metric labels, and the unauthenticated mode's limits."""

import hashlib
import re
import urllib.request

import grpc
import pytest
import torch

from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.wire._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.cli import main
from kvstore.client import Client, DaemonError
from kvstore.daemon.spawn import DaemonProcess
from kvstore.keys import Namespace, chunk_keys
from kvstore.wire.convert import ns_to_proto

TOKENS = {"alice": "alice-secret", "bob": "bob-secret", "carol": "carol-secret"}
SHARED = "system-prompts"


def tenants_file(path, extra: dict[str, str] | None = None) -> str:
    access = {"alice": "write", "bob": "read", "carol": "none"}
    labels = {"alice": "team-a", "bob": "team-b", "carol": "team-c"}
    text = f'[shared]\nname = "{SHARED}"\n'
    for name, token in TOKENS.items():
        text += (f'\n[tenants.{name}]\ntoken_sha256 = "{hashlib.sha256(token.encode()).hexdigest()}"\n'
                 f'shared = "{access[name]}"\nmetrics_label = "{labels[name]}"\n{(extra or {}).get(name, "")}')
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("tenants")
    (root / "daemon.toml").write_text('[shm]\nslots = 32\nslot_bytes = "64KiB"\n[store.host]\n'
                                      'capacity_bytes = "32MiB"\npage_bytes = 4096\n[store.disk]\n'
                                      'capacity_bytes = "64MiB"\n')
    with DaemonProcess(["--config", str(root / "daemon.toml"), "--listen", "127.0.0.1:0",
                        "--data-dir", str(root / "data"), "--metrics", "127.0.0.1:0",
                        "--tenants-file", tenants_file(root / "tenants.toml")]) as proc:
        yield proc


def ns(tenant: str = "") -> Namespace:
    return Namespace("shared-model", 2, 2, 32, chunk_tokens=32, tenant=tenant)  # 16 KiB chunks


PROMPT = list(range(100, 100 + 4 * 32))


def values(seed: float, n: int = 4) -> list[torch.Tensor]:
    return [torch.full(ns().chunk_shape, seed + i, dtype=torch.float16) for i in range(n)]


def same(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_tenant_can_neither_read_detect_pin_delete_nor_overwrite_anothers_chunks(daemon):
    """Finding #1: the tenant was a field the client filled in, so any client could read,
    detect, delete and poison another tenant's chunks by naming that tenant."""
    mine = values(1.0)
    alice = Client(daemon.addr, token=TOKENS["alice"])
    for k, v in zip(chunk_keys(PROMPT, ns("alice")), mine):
        alice.put(k, v, durable=True)
    paths = [(t, Client(daemon.addr, token=TOKENS["bob"], transport=t, retries=0)) for t in ("shm", "remote", "grpc")]
    try:
        for claim in ("alice", "", "bob"):  # bob claims alice's tenant, none, his own
            keys = chunk_keys(PROMPT, ns(claim))
            for transport, bob in paths:
                assert bob.lookup(keys) == 0, (claim, transport)
                assert not bob.contains(keys[0])
                assert bob.get(keys) == [] and bob.get_blob(keys[0]) is None
                assert not bob.get_into(keys[1], torch.empty_like(mine[1]))
                assert bob.pin(keys, 10) == 0 and bob.unpin(keys) == 0
                assert bob.prefetch(keys, wait=True) == []
                assert bob.delete(keys) == 0
            poison = torch.full(ns().chunk_shape, -7.0, dtype=torch.float16)
            paths[0][1].put(keys[0], poison)  # lands in bob's own space
            assert same(paths[1][1].get(keys[:1])[0], poison)
            assert paths[2][1].delete(keys[:1]) == 1
        for claim in ("alice", ""):  # alice's chunks, whatever alice claims
            got = alice.get(chunk_keys(PROMPT, ns(claim)))
            assert len(got) == 4 and all(same(a, b) for a, b in zip(got, mine))
        blob = alice.get_blob(chunk_keys(PROMPT, ns(""))[0])  # a blob comes back naming the key asked for
        alice.put_blob(chunk_keys(PROMPT, ns(""))[0], [blob[:100], blob[100:]])
    finally:
        alice.close()
        for _, bob in paths:
            bob.close()


def test_leases_and_slots_belong_to_the_tenant_that_took_them(daemon):
    with Client(daemon.addr, token=TOKENS["alice"], transport="shm") as alice:
        lease = alice._drive(alice._core.transports.lease())
        ref = lease.take(1)
        (slot, view), = ref
        key = chunk_keys(PROMPT, ns())[0]
        header = pb.PutHeader(namespace=ns_to_proto(key.namespace), prefix_hash=key.prefix_hash, blob_bytes=1000,
                              slot=slot)
        channel = grpc.insecure_channel(daemon.addr)
        bob = pb_grpc.KVStoreStub(channel)
        metadata = (("authorization", f"Bearer {TOKENS['bob']}"),)
        calls = [
            lambda: bob.RenewLease(pb.LeaseRef(lease_id=slot.lease_id), metadata=metadata),
            lambda: list(bob.Get(pb.GetRequest(namespace=header.namespace, prefix_hashes=[key.prefix_hash],
                                               payload=pb.TENSOR, slots=[slot]), metadata=metadata)),
            lambda: bob.Put(iter([pb.PutRequest(header=header)]), metadata=metadata),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        bob.ReleaseLease(pb.LeaseRef(lease_id=slot.lease_id), metadata=metadata)  # no effect on alice's lease
        channel.close()
        lease.give(ref)
        alice.put(key, values(5.0, 1)[0])
        assert alice.get_into(key, torch.empty(ns().chunk_shape, dtype=torch.float16))
        assert alice._drive(alice._core.transports.lease()) is lease, "alice's lease did not survive bob's release"


def test_the_shared_tenant_is_shared_on_purpose_only(daemon):
    keys = chunk_keys(PROMPT, ns(SHARED))
    system = values(40.0)
    with Client(daemon.addr, token=TOKENS["alice"]) as alice, \
            Client(daemon.addr, token=TOKENS["bob"], retries=0) as bob, \
            Client(daemon.addr, token=TOKENS["carol"], retries=0) as carol:
        for k, v in zip(keys, system):
            alice.put(k, v)
        got = bob.get(keys)  # read access
        assert len(got) == 4 and all(same(a, b) for a, b in zip(got, system))
        assert bob.lookup(keys) == 4 and bob.pin(keys, 5) == 4
        for call in (lambda: bob.put(keys[0], system[1]), lambda: bob.delete(keys), lambda: bob.unpin(keys),
                     lambda: carol.lookup(keys), lambda: carol.get(keys)):
            with pytest.raises(DaemonError) as info:
                call()
            assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert alice.unpin(keys) == 4 and alice.lookup(keys) == 4
        assert bob.lookup(chunk_keys(PROMPT, ns("bob"))) == 0  # his own tenant stays his own


def test_metrics_name_no_tenant_and_no_client_string(daemon):
    """Finding #16: per-namespace series were created for every model id a request named, and
    /metrics listed every tenant's model ids and fingerprints."""
    with Client(daemon.addr, token=TOKENS["bob"]) as bob:
        for i in range(20):
            bob.get(chunk_keys(PROMPT, Namespace(f"random-model-{i}", 2, 2, 32, chunk_tokens=32)))
    port = re.search(r"metrics 127\.0\.0\.1:(\d+)", daemon.text).group(1)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for secret in ("alice", "bob", "carol", SHARED, "random-model", "shared-model"):
        assert secret not in text
    assert re.search(r'kvstore_tenant_misses_total\{tenant="team-b"\} ([2-9]\d|\d{3,})', text)
    labels = set(re.findall(r'tenant="([^"]+)"', text))
    assert labels <= {"team-a", "team-b", "team-c", "shared"}


def test_an_unknown_token_is_refused(daemon):
    with Client(daemon.addr, token="not-a-tenant", retries=0) as stranger:
        with pytest.raises(DaemonError) as info:
            stranger.lookup(chunk_keys(PROMPT, ns()))
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_unauthenticated_mode_is_for_loopback_and_says_so(tmp_path, capsys):
    assert main(["serve", "--listen", "0.0.0.0:0", "--data-dir", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "without authentication" in err
    with DaemonProcess(["--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"), "--host-bytes", "16MiB",
                        "--no-shm"]) as daemon:
        assert "auth off (every caller is one tenant; loopback only)" in daemon.text


def test_a_tenant_at_its_quota_replaces_its_own_chunks_never_anothers(tmp_path):
    chunk = 5 * 4096  # what one blob of 128 + 16 KiB occupies: five 4 KiB pages, five 4 KiB disk blocks
    quotas = {"alice": f"host_bytes = {10 * chunk}\ndisk_bytes = {20 * chunk}\n"}
    (tmp_path / "daemon.toml").write_text('[shm]\nenabled = false\n[store.host]\ncapacity_bytes = "8MiB"\n'
                                          'page_bytes = 4096\nprefault = false\n[store.disk]\ncapacity_bytes = "64MiB"\n')
    with DaemonProcess(["--config", str(tmp_path / "daemon.toml"), "--listen", "127.0.0.1:0",
                        "--data-dir", str(tmp_path / "data"), "--metrics", "127.0.0.1:0",
                        "--tenants-file", tenants_file(tmp_path / "tenants.toml", quotas)]) as daemon:
        theirs = chunk_keys(list(range(50_000, 50_000 + 30 * 32)), ns())
        with Client(daemon.addr, token=TOKENS["bob"]) as bob:
            for i, k in enumerate(theirs):
                bob.put(k, values(float(i), 1)[0], durable=True)
        mine = chunk_keys(list(range(60 * 32)), ns())
        with Client(daemon.addr, token=TOKENS["alice"]) as alice:
            for i, k in enumerate(mine):
                alice.put(k, values(float(i), 1)[0], durable=True)
            assert alice.lookup(mine[-20:]) == 20  # her newest 20, within her disk quota
            assert not any(alice.contains(k) for k in mine[:40])  # her oldest made room
            got = alice.get(mine[-1:])
            assert len(got) == 1 and same(got[0], values(59.0, 1)[0])
        with Client(daemon.addr, token=TOKENS["bob"]) as bob:  # bob lost nothing
            assert bob.lookup(theirs) == 30
        port = re.search(r"metrics 127\.0\.0\.1:(\d+)", daemon.text).group(1)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        host = int(float(re.search(r'kvstore_tenant_bytes\{tenant="team-a",tier="host"\} (\S+)', text).group(1)))
        disk = int(float(re.search(r'kvstore_tenant_bytes\{tenant="team-a",tier="disk"\} (\S+)', text).group(1)))
        assert 0 < host <= 10 * chunk and 0 < disk <= 20 * chunk


def test_the_tenant_field_only_tells_apart_a_tenants_own_namespaces(daemon):
    """As in an in-process Store, another tenant field names other chunks; but only ever the
    caller's own: "x" from alice is alice/x, and bob naming "alice/x" reaches bob/alice/x."""
    value = values(70.0, 1)[0]
    with Client(daemon.addr, token=TOKENS["alice"]) as alice, Client(daemon.addr, token=TOKENS["bob"]) as bob:
        alice.put(chunk_keys(PROMPT, ns("x"))[0], value)
        assert alice.lookup(chunk_keys(PROMPT, ns("x"))[:1]) == 1
        assert alice.lookup(chunk_keys(PROMPT, ns("alice/x"))[:1]) == 1  # the same, spelled out
        assert alice.lookup(chunk_keys(PROMPT, ns("y"))[:1]) == 0
        for claim in ("x", "alice/x", "alice"):
            assert bob.lookup(chunk_keys(PROMPT, ns(claim))[:1]) == 0


QUOTA_CHUNK = 128 + 16 * 1024  # one raw blob of quota_ns()


def quota_ns() -> Namespace:
    return Namespace("quota-model", 2, 2, 32, chunk_tokens=32)  # 16 KiB chunks


def test_a_reput_in_a_larger_encoding_counts_against_the_host_quota(tmp_path):
    """A tenant puts many tiny blobs (lz4 of zeros) within its host quota, then re-puts every
    key raw. Before the fix a re-put of a key the tenant held was never checked against its
    quota: it then held 25 times its quota, and host RAM's own eviction pushed out another
    tenant's chunks, which a tenant at its quota must never do."""
    quota = 4 * QUOTA_CHUNK
    (tmp_path / "daemon.toml").write_text(
        '[shm]\nenabled = false\n[store.disk]\nenabled = false\n[store.host]\ncapacity_bytes = "2MiB"\n'
        'page_bytes = 4096\nprefault = false\n')
    with DaemonProcess(["--config", str(tmp_path / "daemon.toml"), "--listen", "127.0.0.1:0",
                        "--data-dir", str(tmp_path / "data"), "--metrics", "127.0.0.1:0",
                        "--tenants-file", tenants_file(tmp_path / "tenants.toml",
                                                       {"alice": f"host_bytes = {quota}\n"})]) as daemon:
        theirs = chunk_keys(list(range(50_000, 50_000 + 40 * 32)), quota_ns())
        with Client(daemon.addr, token=TOKENS["bob"]) as bob:
            for i, k in enumerate(theirs):
                bob.put(k, torch.full(quota_ns().chunk_shape, float(i), dtype=torch.float16))
            assert bob.lookup(theirs) == 40  # ~660 KiB of a 2 MiB host tier
        mine = chunk_keys(list(range(100 * 32)), quota_ns())
        zeros = torch.zeros(quota_ns().chunk_shape, dtype=torch.float16)
        with Client(daemon.addr, token=TOKENS["alice"]) as alice:
            for k in mine:  # ~100 B each: all 100 fit her quota of 4 raw chunks
                alice.put(k, zeros, codec="lz4")
            for k in mine:  # the same keys again, raw: no quota check at all
                alice.put(k, zeros, codec="raw")
            held = alice.lookup(mine)
        port = re.search(r"metrics 127\.0\.0\.1:(\d+)", daemon.text).group(1)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        host = int(float(re.search(r'kvstore_tenant_bytes\{tenant="team-a",tier="host"\} (\S+)', text).group(1)))
        with Client(daemon.addr, token=TOKENS["bob"]) as bob:
            bob_left = bob.lookup(theirs)
        assert host <= quota and bob_left == 40, (
            f"alice holds {host} B in host RAM (quota {quota} B, {held} raw chunks); "
            f"bob kept {bob_left} of his 40 chunks")


def test_a_tenant_attaching_in_a_loop_leaves_other_tenants_their_bulk_sessions(tmp_path):
    """A BulkAttach token counts as a session until it is presented or void (2 x
    hello_timeout_s). It counts against its tenant's ``max_sessions_per_tenant`` too, so a
    tenant asking in a loop without connecting runs out of its own share, never another's."""
    (tmp_path / "daemon.toml").write_text('[shm]\nenabled = false\n[bulk]\nmax_sessions = 4\n'
                                          'max_sessions_per_tenant = 2\nhello_timeout_s = 60.0\n'
                                          '[store.host]\ncapacity_bytes = "8MiB"\npage_bytes = 4096\n'
                                          'prefault = false\n[store.disk]\ncapacity_bytes = "64MiB"\n')
    with DaemonProcess(["--config", str(tmp_path / "daemon.toml"), "--listen", "127.0.0.1:0",
                        "--data-dir", str(tmp_path / "data"),
                        "--tenants-file", tenants_file(tmp_path / "tenants.toml")]) as daemon:
        channel = grpc.insecure_channel(daemon.addr)
        alice = pb_grpc.KVStoreStub(channel)
        metadata = (("authorization", f"Bearer {TOKENS['alice']}"),)
        try:
            with pytest.raises(grpc.RpcError) as info:
                for _ in range(5):  # tokens she never presents
                    alice.BulkAttach(pb.BulkAttachRequest(), metadata=metadata)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "of this tenant" in info.value.details()
            with Client(daemon.addr, token=TOKENS["bob"]) as bob, Client(daemon.addr, token=TOKENS["carol"]) as carol:
                assert bob.path == "bulk" and carol.path == "bulk"
                key = chunk_keys(PROMPT, ns())[0]
                bob.put(key, values(9.0, 1)[0])
                assert same(bob.get([key])[0], values(9.0, 1)[0])
        finally:
            channel.close()
