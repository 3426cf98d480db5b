"""TLS: the daemon serves gRPC over TLS, turns the (unencrypted) bulk channel off, and a
plaintext client cannot talk to it."""

import shutil
import subprocess
import tomllib

import pytest
import torch

from kvstore.client import Client, DaemonError
from kvstore.daemon.spawn import DaemonProcess
from kvstore.keys import Namespace, chunk_keys

TLS_NS = Namespace("tls-model", 2, 2, 8, chunk_tokens=8)


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
    keys = chunk_keys(list(range(3 * 8)), TLS_NS)
    values = [torch.randn(TLS_NS.chunk_shape).half() for _ in keys]
    for transport, path in (("remote", "grpc"), ("shm", "shm")):
        with Client(tls_daemon.addr, tls_ca=tls_daemon.cert, transport=transport) as client:
            assert client.path == path
            for k, v in zip(keys, values):
                client.put(k, v)
            got = client.get(keys)
            assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, values))
    with Client(tls_daemon.addr, tls_ca=tls_daemon.cert) as client:
        bulk = tomllib.loads(client.config())["bulk"]
        assert bulk["enabled"] is False  # what runs, not the default the file left on
    with Client(tls_daemon.addr, retries=0, timeout_s=3) as plain:
        with pytest.raises(DaemonError):
            plain.lookup(keys)


def _signed(root, ca_cert, ca_key, name, cn, server=False):
    key, csr, cert = root / f"{name}.key", root / f"{name}.csr", root / f"{name}.pem"
    subprocess.run(["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
                    "-subj", f"/CN={cn}"], check=True, capture_output=True)
    ext = root / f"{name}.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n" if server else "extendedKeyUsage=clientAuth\n")
    subprocess.run(["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key),
                    "-CAcreateserial", "-out", str(cert), "-days", "1", "-extfile", str(ext)],
                   check=True, capture_output=True)
    return str(cert), str(key)


def test_mutual_tls_names_the_tenant_by_its_certificate(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make test certificates")
    ca_cert, ca_key = tmp_path / "ca.pem", tmp_path / "ca.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out",
                    str(ca_cert), "-days", "1", "-subj", "/CN=test-ca"], check=True, capture_output=True)
    server = _signed(tmp_path, ca_cert, ca_key, "server", "localhost", server=True)
    alice = _signed(tmp_path, ca_cert, ca_key, "alice", "alice.example")
    bob = _signed(tmp_path, ca_cert, ca_key, "bob", "bob.example")
    (tmp_path / "tenants.toml").write_text('[tenants.alice]\ncert_cn = "alice.example"\n'
                                           '[tenants.bob]\ncert_cn = "bob.example"\n')
    with DaemonProcess(["--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"), "--host-bytes", "16MiB",
                        "--disk-bytes", "32MiB", "--tls-cert", server[0], "--tls-key", server[1],
                        "--tls-client-ca", str(ca_cert), "--tenants-file", str(tmp_path / "tenants.toml")]) as daemon:
        assert "client certificates required" in daemon.text
        keys = chunk_keys(list(range(3 * 8)), TLS_NS)
        values = [torch.randn(TLS_NS.chunk_shape).half() for _ in keys]
        with Client(daemon.addr, tls_ca=str(ca_cert), tls_cert=alice[0], tls_key=alice[1]) as a:
            for k, v in zip(keys, values):
                a.put(k, v)
            assert a.lookup(keys) == 3
        with Client(daemon.addr, tls_ca=str(ca_cert), tls_cert=bob[0], tls_key=bob[1]) as b:
            assert b.lookup(keys) == 0 and b.get(keys) == []
        with Client(daemon.addr, tls_ca=str(ca_cert), retries=0, timeout_s=3) as anonymous:
            with pytest.raises(DaemonError):
                anonymous.lookup(keys)
