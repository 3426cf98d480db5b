"""``get_blob`` on the shared-memory path: a blob that cannot fit a slot takes the socket
path, as ``get_into`` of the same chunk does. Before the fix a BLOB Get always named slots,
and the daemon refused any raw chunk of ``slot_bytes`` or more (header + payload) with
OUT_OF_RANGE."""

import torch

from kvstore.client import Client
from kvstore.daemon.spawn import DaemonProcess
from kvstore.keys import Namespace, chunk_keys

BLOB_SLOT_NS = Namespace("blob-slot", num_layers=2, num_kv_heads=2, head_dim=64, chunk_tokens=64)  # 64 KiB fp16


def test_get_blob_of_a_chunk_larger_than_a_slot_takes_the_socket_path(tmp_path):
    cfg = tmp_path / "daemon.toml"
    cfg.write_text(f'listen = "127.0.0.1:0"\n[shm]\ndir = "{tmp_path}"\nslots = 4\nslot_bytes = "64KiB"\n'
                   f'[store.host]\ncapacity_bytes = "16MiB"\npage_bytes = 4096\nprefault = false\n'
                   f'[store.disk]\ncapacity_bytes = "64MiB"\n')
    key = chunk_keys(list(range(64)), BLOB_SLOT_NS)[0]
    value = torch.arange(BLOB_SLOT_NS.chunk_shape[0] * 2 * 64 * 2 * 64, dtype=torch.float16).view(BLOB_SLOT_NS.chunk_shape)
    with DaemonProcess(["--config", str(cfg), "--data-dir", str(tmp_path / "data")]) as daemon:
        with Client(daemon.addr, transport="remote") as remote:
            remote.put(key, value)
            expected = remote.get_blob(key)
        with Client(daemon.addr, shm_slots=2) as local:
            assert local.path == "shm"
            out = torch.empty(BLOB_SLOT_NS.chunk_shape, dtype=torch.float16)
            assert local.get_into(key, out) and torch.equal(out, value)  # the socket path: fine
            assert local.get_blob(key) == expected
