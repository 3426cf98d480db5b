"""Client behaviour that needs no daemon process: argument checks before any RPC, and which
failures are retried (only UNAVAILABLE, with backoff) against a scripted in-process server."""

from concurrent import futures

import grpc
import pytest
import torch

from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.wire._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client import Client, DaemonError
from kvstore.keys import Namespace, chunk_keys

CLIENT_NS = Namespace("client-model", 2, 2, 8, chunk_tokens=8)


class Scripted(pb_grpc.KVStoreServicer):
    """Lookup fails with the scripted codes in turn, then answers 1."""

    def __init__(self, codes):
        self.codes, self.calls = list(codes), 0

    def Lookup(self, request, context):
        self.calls += 1
        if self.codes:
            context.abort(self.codes.pop(0), "scripted failure")
        return pb.CountReply(count=1)


@pytest.fixture
def scripted():
    def start(codes):
        servicer = Scripted(codes)
        server = grpc.server(futures.ThreadPoolExecutor(2))
        pb_grpc.add_KVStoreServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return servicer, f"127.0.0.1:{port}"

    servers = []
    yield start
    for s in servers:
        s.stop(0)


def test_unavailable_is_retried_with_backoff(scripted):
    servicer, addr = scripted([grpc.StatusCode.UNAVAILABLE] * 2)
    with Client(addr, retries=3, backoff_s=0.01, transport="grpc") as client:
        assert client.lookup(chunk_keys(list(range(8)), CLIENT_NS)) == 1
    assert servicer.calls == 3


def test_other_errors_and_exhausted_retries_are_raised(scripted):
    servicer, addr = scripted([grpc.StatusCode.INVALID_ARGUMENT])
    with Client(addr, retries=3, backoff_s=0.01, transport="grpc") as client:
        with pytest.raises(DaemonError) as info:
            client.lookup(chunk_keys(list(range(8)), CLIENT_NS))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and servicer.calls == 1
    servicer, addr = scripted([grpc.StatusCode.UNAVAILABLE] * 5)
    with Client(addr, retries=2, backoff_s=0.01, transport="grpc") as client:
        with pytest.raises(DaemonError, match="UNAVAILABLE"):
            client.lookup(chunk_keys(list(range(8)), CLIENT_NS))
    assert servicer.calls == 3


def test_arguments_are_checked_before_any_rpc():
    with pytest.raises(ValueError, match="transport"):
        Client("127.0.0.1:1", transport="carrier-pigeon")
    with pytest.raises(ValueError, match="HOST:PORT"):
        Client("no-port")
    with Client("127.0.0.1:1", retries=0) as client:
        key = chunk_keys(list(range(8)), CLIENT_NS)[0]
        with pytest.raises(ValueError, match="does not match"):
            client.put(key, torch.zeros(3, dtype=torch.float16))
        with pytest.raises(ValueError, match="does not match"):
            client.get_into(key, torch.zeros(CLIENT_NS.chunk_shape, dtype=torch.float32))
        with pytest.raises(ValueError, match="share a namespace"):
            other = chunk_keys(list(range(8)), Namespace("other", 2, 2, 8, chunk_tokens=8))[0]
            client.lookup([key, other])
        with pytest.raises(ValueError, match="ChunkKey"):
            client.put_blob(b"\0" * 32, [b"x"])


def test_client_options_are_one_dataclass_loadable_like_the_config(tmp_path):
    from kvstore.client import ClientOptions
    from kvstore.config import ConfigError, load_config

    path = tmp_path / "client.toml"
    path.write_text('transport = "remote"\ntimeout_s = 3\npiece_bytes = "64KiB"\n')
    options = load_config(path, ClientOptions)
    assert options.transport == "remote" and options.timeout_s == 3.0 and options.piece_bytes == 64 << 10
    path.write_text("timeout = 3\n")
    with pytest.raises(ConfigError, match="timeout"):
        load_config(path, ClientOptions)
    with pytest.raises(TypeError, match="unknown client option"):
        Client("127.0.0.1:1", timeot_s=3)
    with pytest.raises(ValueError, match="tls_ca"):
        ClientOptions(tls_cert="c.pem", tls_key="k.pem")
    with Client("127.0.0.1:1", options, retries=0) as client:
        assert client.options.transport == "remote" and client.options.retries == 0


def test_retry_decisions():
    from kvstore.client.errors import RAISE, RENEW, RETRY, decide, slots_reusable

    unavailable = DaemonError(grpc.StatusCode.UNAVAILABLE, "gone")
    stale = DaemonError(grpc.StatusCode.FAILED_PRECONDITION, "lease 7 is unknown or expired")
    assert decide(unavailable, 0, False, 2) == RETRY and decide(unavailable, 2, False, 2) == RAISE
    assert decide(stale, 0, False, 2) == RENEW and decide(stale, 0, True, 2) == RAISE
    assert decide(ConnectionResetError(), 0, False, 2) == RETRY
    assert decide(DaemonError(grpc.StatusCode.INVALID_ARGUMENT, "no"), 0, False, 2) == RAISE
    assert decide(ValueError("a bug"), 0, False, 2) == RAISE
    assert slots_reusable(DaemonError(grpc.StatusCode.INVALID_ARGUMENT, "no"))
    for exc in (DaemonError(grpc.StatusCode.DEADLINE_EXCEEDED, ""), TimeoutError(), KeyboardInterrupt()):
        assert not slots_reusable(exc)
