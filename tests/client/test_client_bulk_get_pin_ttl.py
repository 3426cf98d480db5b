"""A bulk-channel Get that carries its chunks' bytes was discarded when it took longer than
0.9 x the daemon's ``bulk.pin_ttl_s``, though nothing was pinned for it.

``ClientCore._each_reply`` checked, after every bulk Get, that its data was read within
``pin_ttl_s * PIN_MARGIN`` of sending it, and else raised ConnectionError ("read after the
daemon may have unpinned it; discarded"). That guards a Get answered with pool views
(``pool_runs``), whose bytes the client copies out of pinned host-pool pages after the
replies. A Get whose bytes travel in the frames (``transport="remote"``, other hosts; no
pool views) holds no pin for the client: the daemon unpins each chunk once its frame is
written. Yet it was discarded and retried, every retry took as long, and it failed with
UNAVAILABLE: a Get of more chunks than the link moves in 27 s (default pin_ttl_s 30 s;
1 GbE: ~3.4 GB, a 26K-token prompt of Llama-3-8B) never succeeded on the bulk channel,
while the gRPC path served it. The check now applies to pool views only.

A real daemon on loopback; its disk is throttled and its host tier holds two chunks, so
every attempt of a 4-chunk Get reads from disk and takes longer than 0.9 x 0.3 s."""

import torch

from kvstore.client import Client
from kvstore.daemon.spawn import DaemonProcess
from kvstore.keys import Namespace, chunk_keys

STREAM_TTL_NS = Namespace("review-stream-ttl", num_layers=2, num_kv_heads=2, head_dim=64, chunk_tokens=64)  # 64 KiB


def value(i):
    return torch.full(STREAM_TTL_NS.chunk_shape, float(i), dtype=torch.float16) + torch.arange(64, dtype=torch.float16)


def test_a_slow_get_over_the_bulk_channel_without_pool_views_is_served(tmp_path):
    keys = chunk_keys(list(range(6 * STREAM_TTL_NS.chunk_tokens)), STREAM_TTL_NS)
    cfg = tmp_path / "daemon.toml"
    cfg.write_text('listen = "127.0.0.1:0"\n[shm]\nenabled = false\n[bulk]\npin_ttl_s = 0.3\n'
                   '[store.host]\ncapacity_bytes = "160KiB"\npage_bytes = 4096\nprefault = false\n'
                   '[store.disk]\ncapacity_bytes = "64MiB"\nread_bytes_per_s = 400000\n')  # 64 KiB: ~0.16 s
    with DaemonProcess(["--config", str(cfg), "--data-dir", str(tmp_path / "data")]) as daemon:
        with Client(daemon.addr, transport="remote") as writer:
            for i, k in enumerate(keys):
                writer.put(k, value(i), durable=True)
        with Client(daemon.addr, transport="remote", retries=1) as client:
            assert client.path == "bulk"
            got = client.get(keys[:4])
            assert len(got) == 4 and all(torch.equal(g, value(i)) for i, g in enumerate(got))
