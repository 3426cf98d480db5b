"""TLS: the daemon serves gRPC over TLS, turns the (unencrypted) bulk channel off, and a
plaintext client cannot talk to it."""

import shutil
import subprocess

import pytest
import torch

from kvstore.client import Client, DaemonError
from kvstore.daemon.spawn import DaemonProcess
from kvstore.keys import Namespace, chunk_keys

NS = Namespace("tls-model", 2, 2, 8, chunk_tokens=8)


@pytest.fixture(scope="module")
def tls_daemon(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    root = tmp_path_factory.mktemp("tls")
    cert, key = root / "cert.pem", root / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    with DaemonProcess(["--listen", "127.0.0.1:0", "--data-dir", str(root / "data"), "--host-bytes", "16MiB",
                        "--disk-bytes", "32MiB", "--tls-cert", str(cert), "--tls-key", str(key)]) as proc:
        proc.cert = str(cert)
        yield proc


def test_tls_round_trip_without_the_bulk_channel(tls_daemon):
    assert "bulk off" in tls_daemon.text and "tls on" in tls_daemon.text
    keys = chunk_keys(list(range(3 * 8)), NS)
    values = [torch.randn(NS.chunk_shape).half() for _ in keys]
    for transport, path in (("remote", "grpc"), ("shm", "shm")):
        with Client(tls_daemon.addr, tls_ca=tls_daemon.cert, transport=transport) as client:
            assert client.path == path
            for k, v in zip(keys, values):
                client.put(k, v)
            got = client.get(keys)
            assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, values))
    with Client(tls_daemon.addr, retries=0, timeout_s=3) as plain:
        with pytest.raises(DaemonError):
            plain.lookup(keys)
