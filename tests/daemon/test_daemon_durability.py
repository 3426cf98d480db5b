"""What survives the daemon going away: a restart keeps the disk tier's chunks, SIGTERM during
a write storm loses nothing acknowledged, kill -9 never leaves a corrupt chunk readable."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kvstore.client import Client
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.daemon.spawn import DaemonProcess
from kvstore.keys import Namespace, chunk_keys
from kvstore.store import Store

DURABILITY_NS = Namespace("durability", num_layers=2, num_kv_heads=2, head_dim=32, chunk_tokens=32)  # 16 KiB fp16
STORM_KEYS = chunk_keys(list(range(400 * DURABILITY_NS.chunk_tokens)), DURABILITY_NS)


def value(i: int) -> torch.Tensor:
    return torch.full(DURABILITY_NS.chunk_shape, float(i % 2048), dtype=torch.float16) + torch.arange(
        DURABILITY_NS.chunk_shape[-1], dtype=torch.float16)


def serve(data_dir, listen="127.0.0.1:0", config: Path | None = None):
    return DaemonProcess(["--listen", listen, "--data-dir", str(data_dir), "--host-bytes", "16MiB",
                          "--disk-bytes", "64MiB", *(["--config", str(config)] if config else [])])


def open_store(data_dir) -> Store:
    return Store(StoreConfig(host=HostTierConfig(capacity_bytes=16 << 20, page_bytes=4096, prefault=False),
                             disk=DiskTierConfig(path=str(data_dir), capacity_bytes=64 << 20)))


def storm(addr, acked: list, stop: threading.Event, threads=3):
    """Clients putting distinct chunks (every other one durable) until the daemon goes away."""

    def worker(t):
        with Client(addr, retries=0, timeout_s=20) as client:
            for i in range(t, len(STORM_KEYS), threads):
                if stop.is_set():
                    return
                try:
                    client.put(STORM_KEYS[i], value(i), durable=i % 2 == 0)
                except Exception:
                    return  # the daemon is going away
                acked.append(i)

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    return workers


def test_sigterm_during_a_write_storm_loses_nothing_acknowledged_and_a_restart_serves_it(tmp_path):
    acked: list[int] = []
    stop = threading.Event()
    with serve(tmp_path / "data") as daemon:
        addr = daemon.addr
        # clients that live across the restart: their lease and bulk sessions go stale
        survivors = [Client(addr, transport=t) for t in ("shm", "remote")]
        for c in survivors:
            assert c.lookup(STORM_KEYS[:1]) in (0, 1) and c.path in ("shm", "bulk")
        workers = storm(daemon.addr, acked, stop)
        deadline = time.monotonic() + 30
        while len(acked) < 60 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert daemon.stop() == 0, daemon.text
        stop.set()
        for w in workers:
            w.join()
    assert len(acked) >= 60
    assert "flushing" in daemon.text and "stopped" in daemon.text
    # durable chunks were on disk at the ack; the rest were flushed on SIGTERM; the restarted
    # daemon's host tier is empty, so every read below comes from the disk tier
    with serve(tmp_path / "data", listen=addr) as daemon:
        with Client(daemon.addr) as client:
            out = torch.empty(DURABILITY_NS.chunk_shape, dtype=torch.float16)
            for i in acked:
                assert client.get_into(STORM_KEYS[i], out), f"acknowledged chunk {i} lost"
                assert torch.equal(out, value(i))
            assert client.stats().tiers["disk"].hits >= len(acked)
        for c in survivors:  # reconnect, re-lease, re-attach transparently
            got = c.get(STORM_KEYS[acked[0] : acked[0] + 1])
            assert len(got) == 1 and torch.equal(got[0], value(acked[0]))
            c.put(STORM_KEYS[-1], value(len(STORM_KEYS) - 1))
            c.close()


def test_kill_9_during_a_write_storm_never_leaves_a_corrupt_chunk_readable(tmp_path):
    acked: list[int] = []
    stop = threading.Event()
    daemon = serve(tmp_path / "data")
    workers = storm(daemon.addr, acked, stop)
    deadline = time.monotonic() + 30
    while len(acked) < 60 and time.monotonic() < deadline:
        time.sleep(0.05)
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    stop.set()
    for w in workers:
        w.join()
    durable = {i for i in list(acked) if i % 2 == 0}
    assert durable
    with open_store(tmp_path / "data") as store:
        out = torch.empty(DURABILITY_NS.chunk_shape, dtype=torch.float16)
        readable = 0
        for i, key in enumerate(STORM_KEYS):
            if store.get_into(key, out):
                readable += 1
                assert torch.equal(out, value(i)), f"chunk {i} readable but wrong"
            else:
                assert i not in durable, f"durable chunk {i} lost"
        assert readable >= len(durable)


def test_a_spawned_daemon_does_not_outlive_the_process_that_started_it(tmp_path):
    """A test run or benchmark that dies must not leave daemons (and /dev/shm files) behind."""
    script = (
        "import os, sys\n"
        "from kvstore.daemon.spawn import DaemonProcess\n"
        f"d = DaemonProcess(['--listen', '127.0.0.1:0', '--data-dir', {str(tmp_path / 'data')!r}, '--host-bytes', '16MiB'])\n"
        "print(d.proc.pid, flush=True)\n"
        "os._exit(0)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": root})
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 30
    while _running(pid):
        assert time.monotonic() < deadline, "the daemon outlived its parent"
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("slot_bytes", [None, "8KiB"])
def test_a_client_leased_before_a_restart_never_reads_the_new_pool_through_the_old_map(tmp_path, slot_bytes):
    """The daemon answered a Get with pool views without checking the request's slots, so a
    client whose lease (and map of the host pool) came from before a restart copied the
    new pool's offsets out of the old pool: another chunk's bytes. Found by the SIGTERM
    storm test, once. Now a Get's slots are checked first, the stale lease is refused, and
    the client leases again. With slots smaller than a chunk (8 KiB, chunks of 16 KiB) a Get
    asks for pool views without slots, naming its lease: refused the same way."""
    keys = STORM_KEYS[:2]
    config = None
    if slot_bytes:
        config = tmp_path / "daemon.toml"
        config.write_text(f'[shm]\nslot_bytes = "{slot_bytes}"\n')
    with serve(tmp_path / "data", config=config) as daemon:
        addr = daemon.addr
        survivor = Client(addr, transport="shm")
        assert survivor.path == "shm"  # leased, and the old pool mapped; no bulk session yet
        with Client(addr) as writer:
            for i, key in enumerate(keys):  # keys[0] takes the old pool's first pages
                writer.put(key, value(i))
        assert daemon.stop() == 0, daemon.text
    try:
        with serve(tmp_path / "data", listen=addr, config=config) as daemon:
            with Client(daemon.addr) as reader:  # keys[1], read first, takes the new pool's first pages
                out = torch.empty(DURABILITY_NS.chunk_shape, dtype=torch.float16)
                assert reader.get_into(keys[1], out) and torch.equal(out, value(1))
            got = survivor.get(keys[1:])
            assert len(got) == 1 and torch.equal(got[0], value(1))
    finally:
        survivor.close()
