"""Bad input through raw stubs and sockets: each gets a specific status and a message,
nothing half-written becomes visible, and the daemon keeps serving everyone else."""

import socket
import threading
import time

import grpc
import pytest
import torch

from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.wire._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.blob import encode_header
from kvstore.client import Client
from kvstore.codecs.raw import tensor_bytes
from kvstore.wire.frames import CHUNK, DONE, END, ERROR, FRAME, GET, HELLO, PUT, RELEASE
from kvstore.daemon.spawn import DaemonProcess
from kvstore.wire.convert import ns_to_proto
from kvstore.keys import Namespace, chunk_keys

BAD_INPUT_NS = Namespace("bad-input", num_layers=2, num_kv_heads=2, head_dim=32, chunk_tokens=32)  # 16 KiB fp16
CONFIG = """
[limits]
max_chunk_bytes = "64KiB"
max_keys_per_request = 8
[shm]
slots = 16
slot_bytes = "64KiB"
[bulk]
frame_timeout_s = 2.0
[store.host]
capacity_bytes = "16MiB"
page_bytes = 4096
[store.disk]
capacity_bytes = "64MiB"
"""
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    (root / "daemon.toml").write_text(CONFIG)
    with DaemonProcess(["--config", str(root / "daemon.toml"), "--listen", "127.0.0.1:0",
                        "--data-dir", str(root / "data")]) as proc:
        yield proc


@pytest.fixture(scope="module")
def stub(daemon):
    channel = grpc.insecure_channel(daemon.addr)
    yield pb_grpc.KVStoreStub(channel)
    channel.close()


@pytest.fixture
def client(daemon):
    with Client(daemon.addr, retries=0) as c:
        yield c


def blob_of(key, value):
    payload = tensor_bytes(value)
    return encode_header(key, 0, value.dtype, value.shape, payload) + bytes(payload)


def keys_and_value(seed):
    keys = chunk_keys(list(range(seed * 1000, seed * 1000 + 4 * BAD_INPUT_NS.chunk_tokens)), BAD_INPUT_NS)
    return keys, torch.full(BAD_INPUT_NS.chunk_shape, float(seed), dtype=torch.float16)


def put_header(key, size, **kw):
    return pb.PutHeader(namespace=ns_to_proto(key.namespace), prefix_hash=key.prefix_hash, blob_bytes=size, **kw)


def code_of(fn):
    with pytest.raises(grpc.RpcError) as info:
        fn()
    assert info.value.details(), "every error carries a message"
    return info.value.code()


def still_serving(client):
    keys, value = keys_and_value(999)
    client.put(keys[0], value)
    out = torch.empty_like(value)
    assert client.get_into(keys[0], out) and torch.equal(out, value)


def test_malformed_and_truncated_messages(daemon, stub, client):
    channel = grpc.insecure_channel(daemon.addr)
    raw_lookup = channel.unary_unary("/kvstore.v1.KVStore/Lookup")
    assert code_of(lambda: raw_lookup(b"\xff\xff\xff\xff")) == Code.INVALID_ARGUMENT
    keys, value = keys_and_value(1)
    whole = pb.PutRequest(header=put_header(keys[0], 200), data=b"x" * 100).SerializeToString()
    raw_put = channel.stream_unary("/kvstore.v1.KVStore/Put")
    assert code_of(lambda: raw_put(iter([whole[: len(whole) // 2]]))) == Code.INVALID_ARGUMENT
    raw_get = channel.unary_stream("/kvstore.v1.KVStore/Get")
    assert code_of(lambda: list(raw_get(b"\x0a\xff\x01"))) == Code.INVALID_ARGUMENT
    assert code_of(lambda: stub.Put(iter([]))) == Code.INVALID_ARGUMENT  # no header at all
    assert code_of(lambda: stub.Put(iter([pb.PutRequest(data=b"abc")]))) == Code.INVALID_ARGUMENT
    channel.close()
    still_serving(client)


def test_wrong_namespace_and_key_length(stub, client):
    keys, value = keys_and_value(2)
    good = ns_to_proto(BAD_INPUT_NS)
    for bad in (pb.NamespaceSpec(), pb.NamespaceSpec(**{**_fields(good), "dtype": "int8"}),
                pb.NamespaceSpec(**{**_fields(good), "tp_rank": 3, "tp_size": 2}),
                pb.NamespaceSpec(**{**_fields(good), "layout": "KLTHD"})):
        assert code_of(lambda: stub.Lookup(pb.KeysRequest(namespace=bad, prefix_hashes=[keys[0].prefix_hash]))) \
            == Code.INVALID_ARGUMENT
    for h in (b"", b"x" * 15, b"x" * 17, keys[0].id):
        assert code_of(lambda: stub.Lookup(pb.KeysRequest(namespace=good, prefix_hashes=[h]))) == Code.INVALID_ARGUMENT
        assert code_of(lambda: list(stub.Get(pb.GetRequest(namespace=good, prefix_hashes=[h])))) == Code.INVALID_ARGUMENT
    too_many = [keys[0].prefix_hash] * 9
    assert code_of(lambda: stub.Delete(pb.KeysRequest(namespace=good, prefix_hashes=too_many))) == Code.INVALID_ARGUMENT
    assert code_of(lambda: stub.Pin(pb.PinRequest(namespace=good, prefix_hashes=[keys[0].prefix_hash], ttl_s=-1))) \
        == Code.INVALID_ARGUMENT
    # a blob whose shape does not match the namespace it is put under
    other = Namespace("bad-input", 2, 2, 16, chunk_tokens=32)
    small = torch.zeros(other.chunk_shape, dtype=torch.float16)
    key = chunk_keys(list(range(32)), BAD_INPUT_NS)[0]
    payload = tensor_bytes(small)
    mismatched = encode_header(key, 0, small.dtype, small.shape, payload) + bytes(payload)
    assert code_of(lambda: stub.Put(iter([pb.PutRequest(header=put_header(key, len(mismatched)), data=mismatched)]))) \
        == Code.INVALID_ARGUMENT
    assert client.lookup([key]) == 0
    still_serving(client)


def _fields(spec):
    return {f.name: getattr(spec, f.name) for f in spec.DESCRIPTOR.fields}


def test_oversized_chunk_and_corrupt_blob(stub, client):
    keys, value = keys_and_value(3)
    assert code_of(lambda: stub.Put(iter([pb.PutRequest(header=put_header(keys[0], (64 << 10) + 1))]))) \
        == Code.RESOURCE_EXHAUSTED
    blob = bytearray(blob_of(keys[0], value))
    blob[5000] ^= 0xFF  # payload checksum no longer matches
    assert code_of(lambda: stub.Put(iter([pb.PutRequest(header=put_header(keys[0], len(blob)), data=bytes(blob))]))) \
        == Code.INVALID_ARGUMENT
    good = blob_of(keys[1], value)  # intact, but names another key
    assert code_of(lambda: stub.Put(iter([pb.PutRequest(header=put_header(keys[0], len(good)), data=good)]))) \
        == Code.INVALID_ARGUMENT
    payload = tensor_bytes(value)
    unknown_codec = encode_header(keys[0], 77, value.dtype, value.shape, payload) + bytes(payload)
    assert code_of(lambda: stub.Put(iter([pb.PutRequest(header=put_header(keys[0], len(unknown_codec)),
                                                        data=unknown_codec)]))) == Code.INVALID_ARGUMENT
    too_long = [pb.PutRequest(header=put_header(keys[1], len(good)), data=good), pb.PutRequest(data=b"extra")]
    assert code_of(lambda: stub.Put(iter(too_long))) == Code.INVALID_ARGUMENT
    assert client.lookup(keys[:2]) == 0
    still_serving(client)


def test_put_stream_that_stops_halfway_stores_nothing(stub, client):
    keys, value = keys_and_value(4)
    blob = blob_of(keys[0], value)
    half = [pb.PutRequest(header=put_header(keys[0], len(blob)), data=blob[:5000])]
    assert code_of(lambda: stub.Put(iter(half))) == Code.INVALID_ARGUMENT

    release = threading.Event()

    def stalls():
        yield pb.PutRequest(header=put_header(keys[1], len(blob)), data=blob[:5000])
        release.wait(30)

    future = stub.Put.future(stalls())
    threading.Timer(0.3, future.cancel).start()
    with pytest.raises(grpc.FutureCancelledError):
        future.result()
    release.set()
    assert client.lookup(keys[:1]) == 0 and not client.contains(keys[1])
    still_serving(client)


def test_client_disconnecting_mid_get(daemon, stub, client):
    keys, value = keys_and_value(5)
    for k in keys:
        client.put(k, value)
    request = pb.GetRequest(namespace=ns_to_proto(BAD_INPUT_NS), prefix_hashes=[k.prefix_hash for k in keys], piece_bytes=64 << 10)
    stream = stub.Get(request)
    next(stream)
    stream.cancel()
    # bulk: ask for chunks on a bulk channel, then hang up without reading them
    sock = attached(stub)
    sock.sendall(frame(GET, pb.GetRequest(namespace=ns_to_proto(BAD_INPUT_NS), prefix_hashes=[k.prefix_hash for k in keys])))
    assert sock.recv(1)
    sock.close()
    assert len(client.get(keys)) == 4
    still_serving(client)


def attached(stub) -> socket.socket:
    attach = stub.BulkAttach(pb.BulkAttachRequest())
    sock = socket.create_connection(("127.0.0.1", attach.port), timeout=30)
    sock.sendall(HELLO.pack(attach.session, attach.token))
    assert sock.recv(1) == b"\x01"
    return sock


def frame(kind, message=None, data=b"", data_len=None) -> bytes:
    meta = b"" if message is None else message if isinstance(message, bytes) else message.SerializeToString()
    return FRAME.pack(kind, len(meta), len(data) if data_len is None else data_len) + meta + data


def recv_exactly(sock, n) -> bytes:
    out = b""
    while len(out) < n:
        more = sock.recv(n - len(out))
        assert more, "the daemon closed the bulk connection"
        out += more
    return out


def bulk_error(sock) -> Code:
    """The status of the ERROR frame the daemon answers with (it must be one)."""
    kind, meta_len, data_len = FRAME.unpack(recv_exactly(sock, FRAME.size))
    assert kind == ERROR and data_len == 0
    error = pb.ErrorReply.FromString(recv_exactly(sock, meta_len))
    assert error.message, "every error carries a message"
    return next(c for c in Code if c.value[0] == error.code)


def test_bulk_channel_rejects_bad_tokens_and_broken_frames(stub, client):
    attach = stub.BulkAttach(pb.BulkAttachRequest())
    sock = socket.create_connection(("127.0.0.1", attach.port))
    sock.sendall(HELLO.pack(attach.session, b"\0" * 32))
    assert sock.recv(1) == b""  # closed: wrong token
    sock = socket.create_connection(("127.0.0.1", attach.port))
    sock.sendall(HELLO.pack(attach.session, attach.token))
    assert sock.recv(1) == b"\x01"
    sock.sendall(frame(PUT, data_len=1 << 30))
    assert closed(sock)  # frame larger than a chunk may be
    for broken in (frame(CHUNK, data=b"x"), frame(99)):  # not a request kind
        sock = attached(stub)
        sock.sendall(broken)
        assert closed(sock)
    still_serving(client)


def closed(sock) -> bool:
    """Whether the daemon closed the connection (a reset, when it left bytes unread)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_bulk_channel_bad_requests_get_errors_and_the_channel_stays_usable(stub, client):
    keys, value = keys_and_value(6)
    blob = blob_of(keys[0], value)
    sock = attached(stub)
    sock.sendall(frame(GET, b"\x0a\xff\x01"))  # truncated GetRequest
    assert bulk_error(sock) == Code.INVALID_ARGUMENT
    sock.sendall(frame(PUT, b"\x0a\xff\x01", blob))  # truncated PutHeader
    assert bulk_error(sock) == Code.INVALID_ARGUMENT
    sock.sendall(frame(GET, pb.GetRequest(namespace=pb.NamespaceSpec(), prefix_hashes=[keys[0].prefix_hash])))
    assert bulk_error(sock) == Code.INVALID_ARGUMENT  # no namespace
    sock.sendall(frame(GET, pb.GetRequest(namespace=ns_to_proto(BAD_INPUT_NS), prefix_hashes=[b"x" * 15])))
    assert bulk_error(sock) == Code.INVALID_ARGUMENT  # key of the wrong length
    sock.sendall(frame(PUT, put_header(keys[0], len(blob) + 1), blob))
    assert bulk_error(sock) == Code.INVALID_ARGUMENT  # fewer bytes than announced
    sock.sendall(frame(PUT, put_header(keys[0], len(blob))))
    assert bulk_error(sock) == Code.INVALID_ARGUMENT  # neither bytes nor a slot
    corrupt = bytearray(blob)
    corrupt[5000] ^= 0xFF
    sock.sendall(frame(PUT, put_header(keys[0], len(blob)), bytes(corrupt)))
    assert bulk_error(sock) == Code.INVALID_ARGUMENT
    slot = pb.SlotRef(lease_id=12345, index=0, generation=1)
    sock.sendall(frame(PUT, put_header(keys[0], len(blob), slot=slot)))
    assert bulk_error(sock) == Code.FAILED_PRECONDITION  # forged slot
    sock.sendall(frame(PUT, put_header(keys[0], len(blob), slot=slot), blob))
    assert bulk_error(sock) == Code.INVALID_ARGUMENT  # a slot and bytes
    assert client.lookup(keys[:1]) == 0
    sock.sendall(frame(PUT, put_header(keys[0], len(blob)), blob))  # after all that, a good one
    kind, meta_len, data_len = FRAME.unpack(recv_exactly(sock, FRAME.size))
    assert (kind, meta_len, data_len) == (DONE, 0, 0)
    assert client.lookup(keys[:1]) == 1
    still_serving(client)


def test_bulk_put_that_stops_halfway_stores_nothing(stub, client):
    keys, value = keys_and_value(8)
    blob = blob_of(keys[0], value)
    sock = attached(stub)
    sock.sendall(frame(PUT, put_header(keys[0], len(blob)), data_len=len(blob)) + blob[:5000])
    sock.close()
    assert client.lookup(keys[:1]) == 0
    still_serving(client)
    assert client.lookup(keys[:1]) == 0


def test_a_bulk_frame_whose_body_stops_coming_cuts_the_connection_after_the_frame_timeout(stub, client):
    """A PUT whose body stops halfway, on a connection left open: the daemon gives up after
    ``bulk.frame_timeout_s`` (2 s here), closes the connection and stores nothing."""
    keys, value = keys_and_value(8)
    blob = blob_of(keys[0], value)
    sock = attached(stub)
    sock.sendall(frame(PUT, put_header(keys[0], len(blob)), data_len=len(blob)) + blob[:5000])
    started = time.monotonic()
    sock.settimeout(30)
    try:
        assert sock.recv(1) == b"", "the daemon answered a frame whose body never came"
    except ConnectionResetError:
        pass
    assert 1.5 < time.monotonic() - started < 20
    sock.close()
    assert client.lookup(keys[:1]) == 0
    still_serving(client)


def test_forged_and_stale_slot_references(stub, client):
    keys, value = keys_and_value(7)
    blob = blob_of(keys[0], value)
    mine = stub.Lease(pb.LeaseRequest(slots=2))
    theirs = stub.Lease(pb.LeaseRequest(slots=1))
    ref = mine.slots[0]

    def put_with(slot):
        return stub.Put(iter([pb.PutRequest(header=put_header(keys[0], len(blob), slot=slot))]))

    def get_with(slot):
        return list(stub.Get(pb.GetRequest(namespace=ns_to_proto(BAD_INPUT_NS), prefix_hashes=[keys[0].prefix_hash], slots=[slot])))

    forged = [
        (pb.SlotRef(lease_id=12345, index=ref.index, generation=ref.generation), Code.FAILED_PRECONDITION),
        (pb.SlotRef(lease_id=ref.lease_id, index=ref.index, generation=ref.generation + 1), Code.FAILED_PRECONDITION),
        (pb.SlotRef(lease_id=ref.lease_id, index=10_000, generation=ref.generation), Code.OUT_OF_RANGE),
        (pb.SlotRef(lease_id=ref.lease_id, index=theirs.slots[0].index, generation=theirs.slots[0].generation),
         Code.PERMISSION_DENIED),
    ]
    for slot, code in forged:
        assert code_of(lambda: put_with(slot)) == code
        assert code_of(lambda: get_with(slot)) == code
    stub.ReleaseLease(pb.LeaseRef(lease_id=mine.lease_id))
    assert code_of(lambda: put_with(ref)) == Code.FAILED_PRECONDITION  # stale: released
    assert code_of(lambda: stub.RenewLease(pb.LeaseRef(lease_id=mine.lease_id))) == Code.FAILED_PRECONDITION
    assert code_of(lambda: stub.Lease(pb.LeaseRequest(slots=100))) == Code.RESOURCE_EXHAUSTED
    stub.ReleaseLease(pb.LeaseRef(lease_id=theirs.lease_id))
    assert client.lookup(keys[:1]) == 0
    still_serving(client)


def test_pool_views_stay_pinned_until_release(stub, client):
    import mmap

    keys, value = keys_and_value(9)
    client.put(keys[0], value)
    lease = stub.Lease(pb.LeaseRequest(slots=1))
    assert lease.pool_path, "the daemon shares its host pool by default"
    with open(lease.pool_path, "rb") as f:
        pool = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    sock = attached(stub)
    sock.sendall(frame(GET, pb.GetRequest(namespace=ns_to_proto(BAD_INPUT_NS), prefix_hashes=[keys[0].prefix_hash],
                                          payload=pb.TENSOR, slots=[lease.slots[0]], pool_views=True)))
    kind, meta_len, data_len = FRAME.unpack(recv_exactly(sock, FRAME.size))
    assert kind == CHUNK and data_len == 0
    runs = pb.GetReply.FromString(recv_exactly(sock, meta_len)).pool_runs
    assert FRAME.unpack(recv_exactly(sock, FRAME.size))[0] == END
    sock.recv(64)  # END's CountReply

    def in_pool() -> bytes:
        return b"".join(pool[o : o + n] for o, n in zip(runs[::2], runs[1::2]))

    def churn(seed):  # more chunks than the 16 MiB host tier holds: every free page is reused
        for i in range(1100):
            client.put(chunk_keys(list(range(seed + i * 32, seed + i * 32 + 32)), BAD_INPUT_NS)[0],
                       torch.full(BAD_INPUT_NS.chunk_shape, float(i % 7 + 10), dtype=torch.float16))

    expected = bytes(tensor_bytes(value))
    assert in_pool() == expected
    client.delete(keys[:1])
    churn(100_000)
    assert in_pool() == expected, "pinned pages were reused before RELEASE"
    sock.sendall(frame(RELEASE))
    churn(200_000)
    assert in_pool() != expected, "released pages were never reused"
    stub.ReleaseLease(pb.LeaseRef(lease_id=lease.lease_id))
    still_serving(client)


def test_pool_views_need_a_bulk_channel_and_a_lease_not_slots(stub):
    """Pool ranges are pinned until the bulk channel's RELEASE, so a gRPC Get cannot ask for
    them; on a bulk channel a Get without slots may (its other chunks come as bytes), naming
    the lease it mapped the pool with: one this daemon does not know maps another pool."""
    keys, _ = keys_and_value(10)
    request = pb.GetRequest(namespace=ns_to_proto(BAD_INPUT_NS), prefix_hashes=[keys[0].prefix_hash], pool_views=True)
    assert code_of(lambda: list(stub.Get(request))) == Code.INVALID_ARGUMENT
    sock = attached(stub)
    for unknown in (0, 12345):
        request.pool_lease = unknown
        sock.sendall(frame(GET, request))
        assert bulk_error(sock) == Code.FAILED_PRECONDITION
    request.pool_lease = stub.Lease(pb.LeaseRequest(slots=1)).lease_id
    sock.sendall(frame(GET, request))
    kind, meta_len, data_len = FRAME.unpack(recv_exactly(sock, FRAME.size))
    assert (kind, data_len) == (END, 0)  # a miss: answered, not refused
    assert pb.CountReply.FromString(recv_exactly(sock, meta_len)).count == 0


def test_a_bulk_client_that_stops_reading_is_cut_off(stub, client):
    keys, value = keys_and_value(11)
    for k in keys:
        client.put(k, value)
    sock = attached(stub)
    get = frame(GET, pb.GetRequest(namespace=ns_to_proto(BAD_INPUT_NS), prefix_hashes=[k.prefix_hash for k in keys],
                                   payload=pb.TENSOR))
    sock.sendall(get * 400)  # 25 MiB of replies: more than both socket buffers hold
    time.sleep(4)  # the daemon's send waits for us for frame_timeout_s (2 s), then gives up
    sock.settimeout(10)
    received = 0
    with pytest.raises((ConnectionResetError, EOFError)):
        while True:
            data = sock.recv(1 << 20)
            if not data:
                raise EOFError
            received += len(data)
    assert received < 400 * 4 * (16 << 10)
    still_serving(client)


def test_chunks_a_socket_carries_are_copies(stub, client):
    """A raw chunk goes out of the host pool into the socket as a copy: the client reads what
    it asked for even when, before it reads, the chunk is deleted and every page reused."""
    keys, value = keys_and_value(12)
    client.put(keys[0], value)
    sock = attached(stub)
    sock.sendall(frame(GET, pb.GetRequest(namespace=ns_to_proto(BAD_INPUT_NS), prefix_hashes=[keys[0].prefix_hash],
                                          payload=pb.TENSOR)))
    time.sleep(0.5)  # the chunk now waits in the socket, unread
    client.delete(keys[:1])
    for i in range(1100):  # more chunks than the 16 MiB host tier holds: every free page is reused
        client.put(chunk_keys(list(range(300_000 + i * 32, 300_000 + i * 32 + 32)), BAD_INPUT_NS)[0],
                   torch.full(BAD_INPUT_NS.chunk_shape, float(i % 7 + 10), dtype=torch.float16))
    kind, meta_len, data_len = FRAME.unpack(recv_exactly(sock, FRAME.size))
    assert kind == CHUNK and data_len == len(tensor_bytes(value))
    recv_exactly(sock, meta_len)
    assert recv_exactly(sock, data_len) == bytes(tensor_bytes(value))
    sock.sendall(frame(RELEASE))
    still_serving(client)


def test_absurd_namespace_dimensions_are_refused_before_anything_is_allocated(stub, client):
    """Finding #22: a Get sized a buffer by the namespace's dimensions before knowing whether
    the key existed; num_layers=10**6 meant a huge allocation or a MemoryError (UNKNOWN)."""
    keys, _ = keys_and_value(20)
    good = _fields(ns_to_proto(BAD_INPUT_NS))
    for bad in ({"num_layers": 10**6}, {"num_layers": 2**32 - 1, "head_dim": 2**32 - 1},
                {"chunk_tokens": 4096},  # 4 MiB: over this daemon's 64 KiB max_chunk_bytes
                {"model_id": "m" * 1000}, {"model_id": "bad\x1fid"}, {"tenant": "t" * 1000}):
        spec = pb.NamespaceSpec(**{**good, **bad})
        for payload in (pb.TENSOR, pb.BLOB):
            request = pb.GetRequest(namespace=spec, prefix_hashes=[keys[0].prefix_hash] * 8, payload=payload)
            assert code_of(lambda: list(stub.Get(request))) == Code.INVALID_ARGUMENT
        assert code_of(lambda: stub.Lookup(pb.KeysRequest(namespace=spec, prefix_hashes=[keys[0].prefix_hash]))) \
            == Code.INVALID_ARGUMENT
        sock = attached(stub)
        sock.sendall(frame(GET, pb.GetRequest(namespace=spec, prefix_hashes=[keys[0].prefix_hash], payload=pb.TENSOR)))
        assert bulk_error(sock) == Code.INVALID_ARGUMENT
    still_serving(client)


def test_pin_ttl_is_bounded(stub, client):
    keys, value = keys_and_value(21)
    client.put(keys[0], value)
    for ttl in (float("inf"), float("nan"), 0.0, 1e9):
        assert code_of(lambda: stub.Pin(pb.PinRequest(namespace=ns_to_proto(BAD_INPUT_NS), prefix_hashes=[keys[0].prefix_hash],
                                                      ttl_s=ttl))) == Code.INVALID_ARGUMENT
    still_serving(client)
