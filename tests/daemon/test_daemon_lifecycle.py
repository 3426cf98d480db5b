"""One daemon per data directory, and shared-memory files that outlive nobody but their owner:
a second daemon (or kvbench, or an in-process Store) on a directory in use is refused in one
line with exit code 2 and leaves nothing behind; a dead daemon's /dev/shm files are removed by
the next one; a live daemon's never are, even from another PID namespace (another container
sharing /dev/shm)."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from bench.cli import main as kvbench
from kvstore.client import Client
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.daemon.shmfiles import ARENA, POOL, SharedFile, remove_orphans
from kvstore.daemon.spawn import DaemonProcess
from kvstore.keys import Namespace, chunk_keys
from kvstore.store import Store
from tiers.base import TierUnavailable

LIFECYCLE_NS = Namespace("lifecycle", num_layers=2, num_kv_heads=2, head_dim=32, chunk_tokens=32)  # 16 KiB fp16
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config(tmp_path, name="daemon.toml"):
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    path = tmp_path / name
    path.write_text(f'listen = "127.0.0.1:0"\n[shm]\ndir = "{shm}"\nslots = 16\nslot_bytes = "64KiB"\n'
                    '[store.host]\ncapacity_bytes = "16MiB"\nprefault = false\n'
                    '[store.disk]\ncapacity_bytes = "64MiB"\n')
    return str(path), shm


def shm_files(shm) -> set[str]:
    return {n for n in os.listdir(shm) if n.startswith((ARENA, POOL))}


def serve_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore", "serve", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": ROOT})


def test_a_second_daemon_on_a_data_directory_in_use_is_refused_in_one_line(tmp_path):
    """Finding #8: a second daemon on a data directory in use deleted the first one's files
    (or died with SIGABRT inside grpc)."""
    cfg, shm = config(tmp_path)
    data = str(tmp_path / "bench" / "store")  # where `kvbench tiers --dir bench` puts its Store
    keys = chunk_keys(list(range(8 * LIFECYCLE_NS.chunk_tokens)), LIFECYCLE_NS)
    values = [torch.full(LIFECYCLE_NS.chunk_shape, float(i), dtype=torch.float16) for i in range(len(keys))]
    with DaemonProcess(["--config", cfg, "--data-dir", data]) as first:
        with Client(first.addr) as client:
            for k, v in zip(keys, values):
                client.put(k, v, durable=True)
        before = shm_files(shm)
        second = serve_cli("--config", cfg, "--data-dir", data)
        assert second.returncode == 2, second.stderr
        assert second.stderr.count("\n") == 1 and "in use" in second.stderr
        assert f"pid {first.proc.pid}" in second.stderr
        assert shm_files(shm) == before, "the refused daemon left (or removed) shared-memory files"
        assert kvbench(["tiers", "--dir", str(tmp_path / "bench"), "--chunks", "2", "--rounds", "1"]) == 2
        with pytest.raises(TierUnavailable, match="in use"):
            Store(StoreConfig(host=HostTierConfig(capacity_bytes=8 << 20, prefault=False),
                              disk=DiskTierConfig(path=data, capacity_bytes=64 << 20)))
        with Client(first.addr) as client:  # the first one lost nothing
            got = client.get(keys)
            assert len(got) == len(keys) and all(torch.equal(a, b) for a, b in zip(got, values))
    assert shm_files(shm) == set()


def test_a_killed_daemons_shared_memory_files_are_removed_by_the_next_one(tmp_path):
    cfg, shm = config(tmp_path)
    dead = DaemonProcess(["--config", cfg, "--data-dir", str(tmp_path / "a")])
    left = shm_files(shm)
    assert len(left) == 2  # its arena and its host pool
    dead.proc.send_signal(signal.SIGKILL)
    dead.proc.wait()
    assert shm_files(shm) == left
    with DaemonProcess(["--config", cfg, "--data-dir", str(tmp_path / "b")]) as daemon:
        mine = shm_files(shm)
        assert len(mine) == 2 and not mine & left
        assert "removed 2 shared-memory file(s)" in daemon.text
        with Client(daemon.addr) as client:
            assert client.path == "shm"
    assert shm_files(shm) == set()


def test_a_file_is_an_orphan_only_when_no_live_process_holds_it(tmp_path):
    """Finding #23: liveness was read from /proc/<pid> of the current PID namespace. A file
    held by a live process is kept whatever its name says; once that process is gone (however
    it ends) the file goes."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from kvstore.daemon.shmfiles import SharedFile\n"
         f"f = SharedFile({str(tmp_path)!r}, {ARENA!r}, 4096); print(f.path, flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    path = holder.stdout.readline().strip()
    foreign = os.path.join(tmp_path, f"{ARENA}4000000-{os.path.basename(path)[-6:]}")
    os.rename(path, foreign)  # named as a process of another PID namespace would name it
    try:
        assert remove_orphans(str(tmp_path)) == 0 and os.path.exists(foreign)
        mine = SharedFile(str(tmp_path), POOL, 4096)
        assert remove_orphans(str(tmp_path)) == 0 and os.path.exists(mine.path)
    finally:
        holder.kill()
        holder.wait()
    assert remove_orphans(str(tmp_path)) == 1 and not os.path.exists(foreign)
    mine.close()
    assert os.listdir(tmp_path) == []


def _descendants(pid: int) -> list[int]:
    out = []
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        for child in map(int, f.read().split()):
            out += [child, *_descendants(child)]
    return out


def _unshare_allowed() -> bool:
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_a_daemon_in_another_pid_namespace_keeps_its_shared_memory_files(tmp_path):
    """Finding #23 with real daemons: one runs in its own PID namespace (as in a container
    sharing /dev/shm) under a pid this namespace does not have; a second daemon starting here
    must not take its files for orphans."""
    if not _unshare_allowed():
        pytest.skip("cannot create a PID namespace here (needs unshare and CAP_SYS_ADMIN)")
    cfg, shm = config(tmp_path)
    # in the new namespace, start the daemon as pid 4000000 (free here: pid_max is 4194304)
    wrapper = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "sh", "-c",
               'echo 3999999 > /proc/sys/kernel/ns_last_pid && "$@"', "sh"]
    inner = DaemonProcess(["--config", cfg, "--data-dir", str(tmp_path / "inner")], wrapper=wrapper)
    try:
        theirs = shm_files(shm)
        assert len(theirs) == 2
        with DaemonProcess(["--config", cfg, "--data-dir", str(tmp_path / "outer")]):
            assert theirs <= shm_files(shm), "a live daemon's files were deleted as orphans"
            with Client(inner.addr, transport="shm") as client:  # its new clients still map them
                key = chunk_keys(list(range(LIFECYCLE_NS.chunk_tokens)), LIFECYCLE_NS)[0]
                client.put(key, torch.ones(LIFECYCLE_NS.chunk_shape, dtype=torch.float16))
                assert client.get_into(key, torch.empty(LIFECYCLE_NS.chunk_shape, dtype=torch.float16))
    finally:
        for pid in _descendants(inner.proc.pid):  # unshare does not pass SIGTERM on: tell the daemon itself
            os.kill(pid, signal.SIGTERM)
        inner.stop()
    deadline = time.monotonic() + 30
    while shm_files(shm):  # the inner daemon cleaned up on SIGTERM
        assert time.monotonic() < deadline, shm_files(shm)
        time.sleep(0.05)


def test_a_daemon_that_gives_up_on_its_flush_still_removes_its_shared_memory_files(tmp_path):
    """Finding 6 of issue 36: a SIGTERM whose write-behind flush took longer than
    ``flush_timeout_s`` exited 1 through ``os._exit`` and left the slot arena and the host
    pool (as large as host RAM) in /dev/shm. Here the disk writes 20 KB/s, so the queued
    copies cannot be flushed in time."""
    cfg, shm = config(tmp_path)
    with open(cfg, "a") as f:
        f.write("read_bytes_per_s = 20000\n")  # [store.disk]: its reads and writes share the cap
    with open(cfg) as f:
        text = f.read()
    with open(cfg, "w") as f:
        f.write("flush_timeout_s = 0.5\n" + text)
    keys = chunk_keys(list(range(8 * LIFECYCLE_NS.chunk_tokens)), LIFECYCLE_NS)
    daemon = DaemonProcess(["--config", cfg, "--data-dir", str(tmp_path / "data")])
    try:
        assert len(shm_files(shm)) == 2
        with Client(daemon.addr) as client:
            for i, k in enumerate(keys):  # 128 KiB of copies to the disk queued: ~6 s at 20 KB/s
                client.put(k, torch.full(LIFECYCLE_NS.chunk_shape, float(i), dtype=torch.float16))
        code = daemon.stop()
    finally:
        daemon.kill()
    assert code == 1 and "write-behind not flushed" in daemon.text, (code, daemon.text[-2000:])
    assert shm_files(shm) == set(), "the daemon that gave up on its flush left its /dev/shm files"


def test_a_started_daemon_takes_its_startup_objects_out_of_the_cyclic_collector(tmp_path):
    """Each full pass of the cyclic garbage collector walked every object the daemon held since
    it started (torch's most of all): under a tenant allocating fast, one ran every few
    seconds and stopped every tenant's requests for ~54 ms (kvstore/daemon/server.py)."""
    cfg, _ = config(tmp_path)
    with DaemonProcess(["--config", cfg, "--data-dir", str(tmp_path / "data")]) as daemon:
        deadline = time.monotonic() + 30
        while not (frozen := re.search(r"took (\d+) startup objects out of the cyclic garbage collector", daemon.text)):
            assert time.monotonic() < deadline, daemon.text
            time.sleep(0.05)
    assert int(frozen.group(1)) > 100_000  # torch alone brings more


def test_a_daemon_without_the_optional_redis_package_starts_and_serves(tmp_path):
    """``redis`` is an extra (``kvstore[redis]``), so a base install has none. Before the fix
    the service imported the Redis tier for one URL helper, and ``kvstore serve`` died on
    ``import redis`` (found on a GPU machine without it)."""
    from kv_daemon import start_daemon

    hidden = tmp_path / "no-redis" / "redis"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('no module named redis (hidden by a test)')\n")
    daemon = start_daemon(tmp_path / "daemon", env={"PYTHONPATH": str(hidden.parent)})
    try:
        ns = Namespace("no-redis", num_layers=1, num_kv_heads=1, head_dim=8, chunk_tokens=4)
        (key,) = chunk_keys(list(range(4)), ns)
        kv = torch.randn(ns.chunk_shape).half()
        with Client(daemon.addr, token_file=daemon.token_file) as client:
            client.put(key, kv)
            assert torch.equal(client.get([key])[0], kv)
            assert "capacity_bytes" in client.config()  # answered through the URL redaction
    finally:
        daemon.stop()
