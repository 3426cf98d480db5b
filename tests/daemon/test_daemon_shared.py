"""Two daemons on loopback, each with its own host RAM and local disk, sharing a PFS
directory and Redis: what one stores, the other finds and serves."""

import pytest
import torch

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

from kvstore.client import Client  # noqa: E402
from kvstore.daemon.spawn import DaemonProcess  # noqa: E402
from kvstore.keys import Namespace, chunk_keys  # noqa: E402


def daemon_toml(tmp_path, name, redis_url) -> str:
    path = tmp_path / f"{name}.toml"
    path.write_text(f"""
listen = "127.0.0.1:0"
[store.host]
capacity_bytes = "32MiB"
[store.disk]
path = "{tmp_path / name / 'disk'}"
capacity_bytes = "64MiB"
[store.pfs]
enabled = true
path = "{tmp_path / 'pfs'}"
capacity_bytes = "64MiB"
[store.redis]
enabled = true
url = "{redis_url}"
key_prefix = "two-daemons:v:"
capacity_bytes = "64MiB"
[store.shared_index]
enabled = true
url = "{redis_url}"
key_prefix = "two-daemons:i:"
""")
    return str(path)


def test_chunk_put_through_one_daemon_is_looked_up_and_read_through_the_other(tmp_path, redis_server):
    ns = Namespace("two-daemons", num_layers=2, num_kv_heads=2, head_dim=32, chunk_tokens=32)
    keys = chunk_keys(list(range(4 * 32)), ns)
    values = [torch.randn(ns.chunk_shape).half() for _ in keys]
    a = DaemonProcess(["--config", daemon_toml(tmp_path, "a", redis_server.url)])
    b = DaemonProcess(["--config", daemon_toml(tmp_path, "b", redis_server.url)])
    try:
        with Client(a.addr) as ca, Client(b.addr, transport="remote") as cb:
            for k, v in zip(keys, values):
                ca.put(k, v, durable=True)
            assert cb.lookup(keys) == 4
            got = cb.get(keys)
            assert len(got) == 4 and all(torch.equal(x, y) for x, y in zip(got, values))
            tiers = cb.stats().tiers
            assert tiers["disk"].hits == 0 and tiers["pfs"].hits + tiers["redis"].hits == 4
    finally:
        a.kill()
        b.kill()
