"""The daemon's one error boundary: the project's own errors become statuses with their
message; anything else is a bug, logged with its traceback and answered INTERNAL, on gRPC and
on the bulk channel alike, never blamed on the caller as INVALID_ARGUMENT."""

import logging

import grpc
import pytest
import torch

from helpers import in_process_daemon
from kvstore.client import Client, DaemonError
from kvstore.daemon.config import DaemonConfig
from kvstore.keys import Namespace, chunk_keys

ERRORS_NS = Namespace("errors", 2, 2, 8, chunk_tokens=8)


@pytest.fixture
def daemon(tmp_path):
    """A daemon in this process (so a test can plant a bug in its Store), on its own loop."""
    config = DaemonConfig(listen="127.0.0.1:0")
    config.shm.dir = str(tmp_path)
    config.store.host.capacity_bytes = 8 << 20
    config.store.host.prefault = False
    config.store.disk.path = str(tmp_path / "data")
    config.store.disk.capacity_bytes = 16 << 20
    with in_process_daemon(config) as daemon:
        yield daemon


@pytest.mark.parametrize("bug", [TypeError("a bug"), ValueError("a bug"), KeyError("a bug"), OSError("a bug")])
def test_a_bug_is_internal_and_logged_never_invalid_argument(daemon, bug, caplog):
    def broken(*args, **kwargs):
        raise bug

    keys = chunk_keys(list(range(8)), ERRORS_NS)
    daemon.store.lookup = broken
    daemon.store.get_into = broken
    daemon.store.read_into = broken
    daemon.store.lend = broken
    daemon.store.lend_many = broken
    with caplog.at_level(logging.ERROR, logger="kvstore.daemon"):
        for transport in ("remote", "grpc"):
            with Client(daemon.address, transport=transport, retries=0) as client:
                client.put(keys[0], torch.zeros(ERRORS_NS.chunk_shape, dtype=torch.float16))
                for call in (lambda: client.lookup(keys), lambda: client.get(keys)):
                    with pytest.raises(DaemonError) as info:
                        call()
                    assert info.value.code == grpc.StatusCode.INTERNAL and "logged" in info.value.message
                assert client.stats().chunks == 1  # the rest keeps working
    assert any(r.exc_info and r.exc_info[1] is bug for r in caplog.records), "the bug was not logged"
