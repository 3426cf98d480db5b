"""The connector's default backend (``auto``) beside the default daemon: an in-process Store
when its data directory is free, the daemon that holds it otherwise, and one clear error,
naming the holder, when the directory is held and no daemon answers (never a traceback
about a lock)."""

import socket

import pytest

from connector import ConnectorConfig, ConnectorConfigError
from connector.backend import open_store
from connector.config import DaemonBackendConfig
from kv_daemon import start_daemon
from kvstore.client import Client
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.store import Store


def config(data_dir, addr="127.0.0.1:50051", token_file=None):
    store = StoreConfig(host=HostTierConfig(capacity_bytes=8 << 20, page_bytes=4096),
                        disk=DiskTierConfig(path=str(data_dir)))
    return ConnectorConfig(store=store, daemon=DaemonBackendConfig(addr=addr, token_file=token_file, timeout_s=2.0))


def test_auto_is_the_default_and_opens_an_in_process_store_on_a_free_directory(tmp_path):
    assert ConnectorConfig().backend == "auto"
    with open_store(config(tmp_path / "data")) as store:
        assert isinstance(store, Store)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with start_daemon(tmp_path_factory.mktemp("auto-backend")) as proc:
        yield proc


def test_auto_shares_the_daemon_that_holds_the_data_directory(daemon):
    cfg = config(daemon.data_dir, daemon.addr, daemon.token_file)
    store = open_store(cfg)
    try:
        assert isinstance(store, Client) and store.addr == daemon.addr
        assert "host" in store.stats().tiers
    finally:
        store.close()


def test_auto_says_who_holds_the_directory_when_no_daemon_answers(daemon):
    with socket.socket() as free:  # a port nothing listens on once closed
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with pytest.raises(ConnectorConfigError, match=rf"held by pid {daemon.proc.pid}.*127.0.0.1:{port}"):
        open_store(config(daemon.data_dir, f"127.0.0.1:{port}"))
