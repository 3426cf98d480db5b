"""Requests that end before the daemon is done with them: Gets that time out on a slow disk,
clients that disconnect, bulk clients that never send RELEASE. The daemon fences its own
writes before a slot is reused, the client never reuses a slot whose request did not end
with an answer, leases come back, pinned host pages come back, and no good replica is ever
taken for a corrupt one."""

import asyncio
import socket
import time

import grpc
import pytest
import torch

from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.wire._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client import AsyncClient, Client, DaemonError
from kvstore.daemon.spawn import DaemonProcess
from kvstore.keys import Namespace, chunk_keys
from kvstore.wire.convert import ns_to_proto
from kvstore.wire.frames import CHUNK, END, FRAME, GET, HELLO

CANCEL_NS = Namespace("cancel", num_layers=2, num_kv_heads=2, head_dim=64, chunk_tokens=64)  # 64 KiB fp16
SLOW = 256_000  # disk bytes per second: a chunk takes ~0.25 s to read


def config(tmp_path, disk_bytes_per_s=0, extra=""):
    path = tmp_path / f"daemon-{disk_bytes_per_s}.toml"
    path.write_text(f'listen = "127.0.0.1:0"\n[shm]\ndir = "{tmp_path}"\nslots = 16\nslot_bytes = "128KiB"\n'
                    f'lease_ttl_s = 60.0\n[store.host]\ncapacity_bytes = "16MiB"\npage_bytes = 4096\nprefault = false\n'
                    f'[store.disk]\ncapacity_bytes = "64MiB"\nread_bytes_per_s = {disk_bytes_per_s}\n{extra}')
    return str(path)


def value(i):
    return torch.full(CANCEL_NS.chunk_shape, float(i), dtype=torch.float16) + torch.arange(64, dtype=torch.float16)


def wait_until(predicate, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.fixture
def slow_daemon(tmp_path):
    """A daemon whose chunks are on a slow disk only (put, then restarted with an empty host tier)."""
    keys = chunk_keys(list(range(8 * CANCEL_NS.chunk_tokens)), CANCEL_NS)
    data = str(tmp_path / "data")
    with DaemonProcess(["--config", config(tmp_path), "--data-dir", data]) as first:
        with Client(first.addr) as client:
            for i, k in enumerate(keys):
                client.put(k, value(i), durable=True)
    with DaemonProcess(["--config", config(tmp_path, SLOW), "--data-dir", data, "--no-bulk"]) as daemon:
        daemon.keys = keys
        yield daemon


def settled(daemon) -> pb.StatsReply:
    """Stats once every read the daemon started has finished and every slot is back."""
    with Client(daemon.addr, transport="grpc") as observer:
        wait_until(lambda: observer.stats_reply().shm_slots_free == 16, "the slots never came back")
        return observer.stats_reply()


def test_a_get_that_timed_out_never_corrupts_a_slot_or_a_replica(slow_daemon):
    """Finding #4: a Get that timed out on the shm path (over gRPC) left the daemon reading
    into the slot, the client reused the slot, and the daemon's checksum then failed on the
    client's bytes: it deleted the chunk's only good disk replica as corrupt."""
    keys = slow_daemon.keys
    others = chunk_keys(list(range(10_000, 10_000 + 8 * CANCEL_NS.chunk_tokens)), CANCEL_NS)
    with Client(slow_daemon.addr, transport="shm", shm_slots=1, timeout_s=0.05, retries=0) as client:
        for i, key in enumerate(keys[:4]):
            with pytest.raises(DaemonError) as info:
                client.get_into(key, torch.empty(CANCEL_NS.chunk_shape, dtype=torch.float16))
            assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            client.put(others[i], value(100 + i))  # in the old client: into the slot the daemon still wrote
    stats = settled(slow_daemon)
    assert sum(t.corruptions for t in stats.tiers) == 0
    with Client(slow_daemon.addr, transport="shm", timeout_s=30) as reader:
        out = torch.empty(CANCEL_NS.chunk_shape, dtype=torch.float16)
        for i, key in enumerate(keys[:4]):
            assert reader.get_into(key, out) and torch.equal(out, value(i)), f"chunk {i} lost or wrong"
            assert reader.get_into(others[i], out) and torch.equal(out, value(100 + i))


def test_the_async_client_releases_the_lease_of_a_get_that_timed_out(slow_daemon):
    """Finding #4: the AsyncClient dropped its lease without releasing it, so after a few
    timeouts every slot stayed leased and further operations were refused."""

    async def timeouts():
        async with AsyncClient(slow_daemon.addr, shm_slots=4, timeout_s=0.05, retries=0) as client:
            for key in slow_daemon.keys[:6]:  # 6 leases of 4 slots: more than the arena's 16
                with pytest.raises(DaemonError) as info:
                    await client.get_into(key, torch.empty(CANCEL_NS.chunk_shape, dtype=torch.float16))
                assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED

    async def then_shm_again():
        async with AsyncClient(slow_daemon.addr, transport="shm", shm_slots=16) as client:
            await client.put(chunk_keys(list(range(20_000, 20_000 + 64)), CANCEL_NS)[0], value(1))
            assert await client.path() == "shm"

    asyncio.run(timeouts())
    stats = settled(slow_daemon)  # released, and reclaimed once the daemon's reads ended
    assert sum(t.corruptions for t in stats.tiers) == 0
    asyncio.run(then_shm_again())


def test_a_client_that_hangs_up_mid_get_leaves_its_slots_to_the_daemon_until_its_read_ends(slow_daemon):
    """The daemon side of #4: a cancelled Get's read keeps its slot busy until the executor
    is done with it, and the slot then returns (never earlier, never lost)."""
    channel = grpc.insecure_channel(slow_daemon.addr)
    stub = pb_grpc.KVStoreStub(channel)
    lease = stub.Lease(pb.LeaseRequest(slots=2))
    keys = slow_daemon.keys[4:6]
    stream = stub.Get(pb.GetRequest(namespace=ns_to_proto(CANCEL_NS), prefix_hashes=[k.prefix_hash for k in keys],
                                    payload=pb.TENSOR, slots=list(lease.slots)))
    stream.cancel()
    stub.ReleaseLease(pb.LeaseRef(lease_id=lease.lease_id))
    channel.close()
    settled(slow_daemon)
    with Client(slow_daemon.addr, transport="shm") as client:
        got = client.get(keys)
        assert len(got) == 2 and all(torch.equal(g, value(4 + i)) for i, g in enumerate(got))


def attached(daemon_addr: str) -> socket.socket:
    channel = grpc.insecure_channel(daemon_addr)
    attach = pb_grpc.KVStoreStub(channel).BulkAttach(pb.BulkAttachRequest())
    channel.close()
    sock = socket.create_connection(("127.0.0.1", attach.port), timeout=30)
    sock.sendall(HELLO.pack(attach.session, attach.token))
    assert sock.recv(1) == b"\x01"
    return sock


def recv_exactly(sock, n) -> bytes:
    out = b""
    while len(out) < n:
        more = sock.recv(n - len(out))
        assert more, "the daemon closed the bulk connection"
        out += more
    return out


def test_pins_of_a_bulk_client_that_never_releases_them_come_back(tmp_path):
    """Finding #11: host pages a bulk Get pinned for its client stayed pinned until RELEASE,
    the next request or the connection's end; a client that goes silent (a vanished host: no
    FIN) held them for good. Now they are released after bulk.pin_ttl_s and the connection
    is cut off."""
    cfg = config(tmp_path, extra='[bulk]\npin_ttl_s = 3.0\n')
    with DaemonProcess(["--config", cfg, "--data-dir", str(tmp_path / "data")]) as daemon:
        keys = chunk_keys(list(range(16 * CANCEL_NS.chunk_tokens)), CANCEL_NS)
        with Client(daemon.addr, transport="remote") as client:
            for i, k in enumerate(keys):
                client.put(k, value(i))
            full = client.stats().tiers["host"].used_bytes
            channel = grpc.insecure_channel(daemon.addr)
            lease = pb_grpc.KVStoreStub(channel).Lease(pb.LeaseRequest(slots=16))
            channel.close()
            sock = attached(daemon.addr)  # a Get whose chunks stay pinned while the client copies them
            meta = pb.GetRequest(namespace=ns_to_proto(CANCEL_NS), prefix_hashes=[k.prefix_hash for k in keys],
                                 payload=pb.TENSOR, slots=list(lease.slots), pool_views=True).SerializeToString()
            sock.sendall(FRAME.pack(GET, len(meta), 0) + meta)
            for _ in keys:
                kind, meta_len, data_len = FRAME.unpack(recv_exactly(sock, FRAME.size))
                assert kind == CHUNK and data_len == 0
                recv_exactly(sock, meta_len)
            assert FRAME.unpack(recv_exactly(sock, FRAME.size))[0] == END
            # ... and no RELEASE, ever: the client's host is gone
            assert client.delete(keys) == len(keys)
            assert client.stats().tiers["host"].used_bytes == full, "the pinned pages went before the deadline"
            wait_until(lambda: client.stats().tiers["host"].used_bytes < full // 2, "pinned pages never came back")
            sock.settimeout(10)
            while sock.recv(1 << 16):
                pass
            sock.close()
            assert "without RELEASE" in daemon.text


def test_an_async_get_the_caller_cancels_writes_nothing_after_it_ends(slow_daemon):
    """The caller gives up (wait_for): when the cancelled call ends, nothing writes into its
    tensors any more, its slots are never reused, and the client goes on working."""

    async def scenario():
        async with AsyncClient(slow_daemon.addr, transport="shm", shm_slots=8) as client:
            outs = [torch.zeros(CANCEL_NS.chunk_shape, dtype=torch.float16) for _ in range(2)]
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.get_many_into(slow_daemon.keys[6:8], outs), 0.05)
            before = [o.clone() for o in outs]
            fresh = chunk_keys(list(range(30_000, 30_000 + 64)), CANCEL_NS)[0]
            await client.put(fresh, value(9))  # through a new lease: the old one is retired
            got = await client.get([fresh])
            assert len(got) == 1 and torch.equal(got[0], value(9))
            return outs, before

    outs, before = asyncio.run(scenario())
    assert sum(t.corruptions for t in settled(slow_daemon).tiers) == 0  # the abandoned reads have ended
    assert all(torch.equal(a, b) for a, b in zip(outs, before)), "a tensor changed after the call ended"
