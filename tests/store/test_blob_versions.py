"""Blob format versions 1 and 2 side by side (docs/blob-format.md): a store writes the one
its config names and reads and verifies both, so blobs written before an upgrade stay
readable, and a damaged one of either is found. Real files, real Stores, a real daemon."""

from __future__ import annotations

import pytest
import torch

from helpers import chunks, in_process_daemon, same, store_config
from kvstore.blob import decode_header
from kvstore.client import Client
from kvstore.client.options import ClientOptions
from kvstore.config import ConfigError, StoreConfig
from kvstore.daemon.config import DaemonConfig
from kvstore.store import Store


def disk_versions(store: Store, keys) -> list[int]:
    """The format version of each key's file on the store's disk tier."""
    disk = store.tier("disk")
    return [decode_header(disk.peek(key.id, 128)).version for key in keys]


@pytest.mark.parametrize("before,after", [(1, 2), (2, 1)])
def test_a_store_reads_and_verifies_the_blobs_of_either_version_it_finds_on_disk(tmp_path, before, after):
    """An upgrade (1 -> 2) or a step back (2 -> 1) over the same disk: every chunk found
    there is read back (the disk verifies payloads), and new puts are of the new version."""
    keys, values = chunks(6)
    with Store(store_config(tmp_path, blob_version=before)) as store:
        for key, value in zip(keys[:4], values[:4]):
            store.put(key, value, durable=True)
        assert disk_versions(store, keys[:4]) == [before] * 4
    with Store(store_config(tmp_path, blob_version=after)) as store:
        for key, value in zip(keys[:4], values[:4]):  # host RAM is empty: each is read from disk
            out = torch.empty_like(value)
            assert store.get_into(key, out) and same(out, value)
        for key, value in zip(keys[4:], values[4:]):
            store.put(key, value, durable=True)
        assert disk_versions(store, keys) == [before] * 4 + [after] * 2
        assert store.stats().tiers["disk"].corruptions == 0


@pytest.mark.parametrize("version", [1, 2])
def test_a_damaged_payload_of_either_version_is_never_returned(tmp_path, version):
    keys, values = chunks(1)
    with Store(store_config(tmp_path, blob_version=version)) as store:
        store.put(keys[0], values[0], durable=True)
        path = store.tier("disk").path_of(keys[0].id)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))
    with Store(store_config(tmp_path, blob_version=3 - version)) as store:  # the other version's reader
        assert not store.get_into(keys[0], torch.empty_like(values[0]))
        assert store.stats().tiers["disk"].corruptions == 1


def test_an_unknown_blob_version_in_the_config_is_refused():
    with pytest.raises(ConfigError, match="blob_version"):
        StoreConfig(blob_version=3).validate()
    with pytest.raises(ValueError, match="blob_version"):
        ClientOptions(blob_version=3)


@pytest.mark.parametrize("transport", ["shm", "remote", "grpc"])
@pytest.mark.parametrize("version", [1, 2])
def test_a_daemon_checks_and_keeps_a_clients_blobs_of_either_version(tmp_path, transport, version):
    """An older client writes version 1: the daemon checks the payload it copies into host
    RAM against that version's checksum, keeps the blob as it came, and refuses nothing."""
    config = DaemonConfig(listen="127.0.0.1:0")
    config.shm.enabled = transport == "shm"
    config.store = store_config(tmp_path, disk=None)
    keys, values = chunks(3)
    with in_process_daemon(config) as daemon, Client(daemon.address, transport=transport,
                                                     blob_version=version) as client:
        for key, value in zip(keys, values):
            client.put(key, value)
        for key, value in zip(keys, values):
            out = torch.empty_like(value)
            assert client.get_into(key, out) and same(out, value)
            assert decode_header(daemon.store.get_blob(key)).version == version
