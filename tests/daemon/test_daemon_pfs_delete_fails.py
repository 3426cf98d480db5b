"""Finding 5 of issue 36: a PFS delete whose unlink failed was reported as done. PfsTier.delete
forgot the file in its view before the unlink and swallowed the unlink's OSError, so the
daemon's Delete answered 1, the very next Lookup found the chunk again (the view stats a key
it does not know), and in a cluster its budget bytes were freed while the file stayed.
Here the shared mount is a real tmpfs remounted read-only under a running daemon."""

from __future__ import annotations

import torch

from fsfaults import remount_read_only, remount_read_write, tiny_tmpfs
from kvstore.client import Client, DaemonError
from kvstore.daemon.spawn import DaemonProcess
from kvstore.keys import Namespace, chunk_keys

PFS_DELETE_NS = Namespace("pfs-delete", 2, 2, 32, chunk_tokens=32)  # 16 KiB fp16 chunks


def test_a_delete_the_shared_mount_refuses_is_reported_and_the_chunk_stays_counted(tmp_path):
    with tiny_tmpfs(tmp_path / "pfs", 8 << 20) as mount:
        (tmp_path / "daemon.toml").write_text(
            '[shm]\nenabled = false\n[store.host]\ncapacity_bytes = "8MiB"\npage_bytes = 4096\nprefault = false\n'
            f'[store.disk]\nenabled = false\n[store.pfs]\nenabled = true\npath = "{mount}"\n'
            'capacity_bytes = "4MiB"\n')
        key = chunk_keys(list(range(32)), PFS_DELETE_NS)[0]
        value = torch.full(PFS_DELETE_NS.chunk_shape, 2.0, dtype=torch.float16)
        with DaemonProcess(["--config", str(tmp_path / "daemon.toml"), "--listen", "127.0.0.1:0",
                            "--data-dir", str(tmp_path / "data")]) as daemon:
            with Client(daemon.addr, retries=0) as client:
                client.put(key, value, durable=True)  # on the shared mount when acknowledged
                remount_read_only(mount)
                try:
                    try:
                        reported = f"done ({client.delete([key])} deleted)"
                    except DaemonError as exc:
                        reported = f"failed: {exc}"
                    counted = client.stats().tiers["pfs"].used_bytes
                finally:
                    remount_read_write(mount)
                assert reported.startswith("failed") and "Read-only file system" in reported, reported
                assert counted > 0, "the file stays on the mount, uncounted"
                assert client.lookup([key]) == 1  # still there, and found
                assert torch.equal(client.get([key])[0], value)
                assert client.delete([key]) == 1 and client.lookup([key]) == 0  # once the mount allows it
