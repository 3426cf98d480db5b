"""The daemon as a real process, driven through the real client: round trips on every path,
the index operations, stats, metrics, the CLI's stats/ping, token auth and the benchmark's
quick mode (tenants: tests/daemon/test_daemon_tenants.py). The daemon requires a bearer token; ``connect`` supplies it."""

import asyncio
import json
import re
import socket
import statistics
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from bench.cli import main as kvbench
from helpers import NS
from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.cli import main
from kvstore.client import AsyncClient, Client, DaemonError
from kvstore.config import load_config
from kvstore.daemon.config import DaemonConfig
from kvstore.daemon.spawn import DaemonProcess
from kvstore.keys import Namespace, chunk_keys
from kvstore.wire.frames import HELLO

BIG = Namespace("test-big", num_layers=4, num_kv_heads=2, head_dim=64, chunk_tokens=128, dtype="bfloat16")  # 256 KiB

CONFIG = """
[limits]
max_chunk_bytes = "4MiB"
max_keys_per_request = 64
[shm]
slots = 16
slot_bytes = "512KiB"
lease_ttl_s = 2.0
[store.host]
capacity_bytes = "64MiB"
page_bytes = 4096
[store.disk]
capacity_bytes = "256MiB"
"""


TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("daemon")
    (root / "daemon.toml").write_text(CONFIG)
    (root / "token").write_text(TOKEN + "\n")
    with DaemonProcess(["--config", str(root / "daemon.toml"), "--listen", "127.0.0.1:0",
                        "--data-dir", str(root / "data"), "--metrics", "127.0.0.1:0",
                        "--auth-token-file", str(root / "token")]) as proc:
        proc.token_file = str(root / "token")
        yield proc


def connect(daemon, **kw) -> Client:
    return Client(daemon.addr, token=TOKEN, **kw)


def chunks(n, ns=NS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    keys = chunk_keys(torch.randint(0, 50_000, (n * ns.chunk_tokens,), generator=gen).tolist(), ns)
    dtype = getattr(torch, ns.dtype)
    return keys, [torch.randn(ns.chunk_shape, generator=gen).to(dtype) for _ in keys]


def same(a, b):
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_start_line_names_address_tiers_and_capacities(daemon):
    line = next(line for line in daemon.log if "listening on" in line)
    assert daemon.addr.startswith("127.0.0.1:")
    assert "host 64MiB" in line and "disk 256MiB" in line and "shm 16x512KiB + host pool" in line


@pytest.mark.parametrize("transport,path", [("shm", "shm"), ("remote", "bulk"), ("grpc", "grpc")])
@pytest.mark.parametrize("ns", [NS, BIG], ids=["1KiB", "256KiB"])
def test_round_trip_is_bit_exact_on_every_path(daemon, transport, path, ns):
    # a seed of its own per case: the daemon is the module's, and another test's chunks put here
    # would be found there (hash() of a str changes per process, and once hit test_index_operations' 7)
    keys, values = chunks(5, ns, seed=1000 + 10 * ["shm", "remote", "grpc"].index(transport) + (ns is BIG))
    values[0].view(-1)[0] = float("nan")
    with connect(daemon, transport=transport, piece_bytes=64 << 10) as client:
        assert client.path == path
        for i, (k, v) in enumerate(zip(keys, values)):
            client.put(k, v, parent=keys[i - 1] if i else None, durable=i % 2 == 0)
        assert client.lookup(keys) == 5
        got = client.get(keys)
        assert len(got) == 5 and all(same(a, b) for a, b in zip(got, values))
        out = torch.empty_like(values[3])
        assert client.get_into(keys[3], out) and same(out, values[3])
        blob = client.get_blob(keys[2])
        assert blob is not None and len(blob) == 128 + values[2].numel() * values[2].element_size()
        client.put_blob(keys[2].id, [blob[:100], blob[100:]])  # pieces, by key id of a known namespace
        assert client.get_into(keys[2], out) and same(out, values[2])


@pytest.mark.parametrize("transport", ["shm", "remote"])
def test_encoded_chunks_take_the_copying_path_beside_zero_copy_ones(daemon, transport):
    """Raw chunks in host RAM are served without a daemon-side copy (a same-host client copies
    them out of the shared host pool; a socket sends straight from it); an encoded chunk in
    the same Get is decoded into a slot or a buffer instead."""
    keys, values = chunks(3, BIG, seed=31)
    with connect(daemon, transport=transport) as client:
        assert transport != "shm" or client._drive(client._core.transports.lease()).pool is not None
        client.put(keys[0], values[0])
        client.put(keys[1], values[1], codec="int8")
        client.put(keys[2], values[2])
        with connect(daemon, transport="grpc") as reference:
            decoded = reference.get(keys[1:2])[0]
        assert not same(decoded, values[1])  # int8 is lossy: the daemon really decoded it
        got = client.get(keys)
        assert len(got) == 3 and same(got[0], values[0]) and same(got[1], decoded) and same(got[2], values[2])


def test_index_operations_match_the_store(daemon):
    keys, values = chunks(6, seed=7)
    with connect(daemon) as client:
        for i in (0, 1, 3):
            client.put(keys[i], values[i])
        assert client.lookup(keys) == 2
        assert client.contains(keys[3]) and not client.contains(keys[2])
        assert len(client.get(keys)) == 2  # stops at the first miss
        assert client.get_blob(keys[2]) is None
        assert not client.get_into(keys[2], torch.empty_like(values[2]))
        assert client.pin(keys, ttl_s=30) == 3
        assert client.unpin(keys[:2]) == 2
        assert isinstance(client.prefetch(keys, wait=True), list)
        assert client.delete(keys) == 3
        assert client.lookup(keys) == 0
        assert client.lookup([]) == 0 and client.get([]) == []


def test_stats_metrics_and_cli(daemon, capsys):
    keys, values = chunks(2, seed=11)
    with connect(daemon) as client:
        client.put(keys[0], values[0], durable=True)
        client.get(keys)  # one hit, one miss
        stats = client.stats()
    assert {"host", "disk"} <= set(stats.tiers) and stats.hits >= 1 and stats.misses >= 1
    assert stats.tiers["host"].capacity_bytes == 64 << 20

    port = re.search(r"metrics 127\.0\.0\.1:(\d+)", daemon.text).group(1)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'kvstore_tier_hits_total{tier="host"}' in text
    assert 'kvstore_tier_capacity_bytes{tier="disk"}' in text
    assert 'kvstore_tier_recodes_total{tier="host"} 0.0' in text and "kvstore_recode_failures_total 0.0" in text
    assert 'kvstore_tier_lossy_hits_total{tier="disk"} 0.0' in text
    assert "kvstore_write_behind_queue" in text and "kvstore_io_inflight" in text
    assert 'kvstore_rpc_seconds_bucket{le="0.001",method="Get"}' in text
    assert re.search(r'kvstore_tenant_misses_total\{tenant="default"\} [1-9]', text)
    assert "test-model" not in text  # no label takes a value a client sent
    dashboard = (Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json").read_text()
    charted = set(re.findall(r"kvstore_[a-z_]+", dashboard))
    assert charted and all(name in text for name in charted), charted - {n for n in charted if n in text}

    token = ["--auth-token-file", daemon.token_file]
    assert main(["stats", "--addr", daemon.addr, *token]) == 0
    out = capsys.readouterr().out
    assert f"daemon {daemon.addr}:" in out and "hit rate" in out
    assert re.search(r"^host\s+\d+(\.\d)?[KMG]?i?B\s+64MiB", out, re.M)
    assert main(["stats", "--addr", daemon.addr, *token, "--watch", "0.05", "--count", "2"]) == 0
    out = capsys.readouterr().out  # a live view: the second sample has rates since the first
    assert out.count(f"daemon {daemon.addr}:") == 2 and re.search(r"^host .* \S+B/s\s+\S+B/s$", out, re.M)
    assert main(["ping", "--addr", daemon.addr, *token]) == 0
    assert "SERVING" in capsys.readouterr().out


def test_config_daemon_prints_the_running_daemons_configuration(daemon, capsys, tmp_path):
    """File and flags merged, as it runs: what `kvstore config --daemon` shows, loadable again."""
    assert main(["config", "--daemon", "--addr", daemon.addr, "--auth-token-file", daemon.token_file]) == 0
    shown = tmp_path / "running.toml"
    shown.write_text(capsys.readouterr().out)
    running = load_config(shown, DaemonConfig)
    assert running.listen == "127.0.0.1:0" and running.auth_token_file == daemon.token_file  # flags
    assert running.store.host.capacity_bytes == 64 << 20 and running.metrics == "127.0.0.1:0"
    assert 'eviction_policy = "default"  # = shadow-vote' in shown.read_text()
    assert main(["config", "--daemon", "--addr", daemon.addr]) == 2  # no token: one line, exit 2
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_lease_of_a_vanished_client_expires_and_its_slots_return(daemon):
    with connect(daemon, transport="shm", shm_slots=4) as client:
        keys, values = chunks(1, seed=3)
        client.put(keys[0], values[0])
        before = client.stats_reply().shm_slots_free
        client._core.transports._lease = None  # forget the lease without releasing it, as a dead client would
        with connect(daemon, transport="grpc") as other:
            deadline = time.monotonic() + 10
            while other.stats_reply().shm_slots_free < before + 4:
                assert time.monotonic() < deadline, "lease never expired"
                time.sleep(0.2)


@pytest.mark.parametrize("transport,path", [("shm", "shm"), ("remote", "bulk"), ("grpc", "grpc")])
def test_async_client_has_the_same_methods(daemon, transport, path):
    asyncio.run(_async_round_trip(daemon.addr, transport, path))


async def _async_round_trip(addr, transport, path):
    keys, values = chunks(3, BIG, seed=5)
    async with AsyncClient(addr, token=TOKEN, transport=transport, piece_bytes=64 << 10) as client:
        assert await client.path() == path
        await asyncio.gather(*(client.put(k, v, durable=i == 0) for i, (k, v) in enumerate(zip(keys, values))))
        assert await client.lookup(keys) == 3
        got = await client.get(keys)
        assert len(got) == 3 and all(same(a, b) for a, b in zip(got, values))
        outs = [torch.empty_like(v) for v in values]
        assert all(await asyncio.gather(*(client.get_into(k, o) for k, o in zip(keys, outs))))
        assert all(same(a, b) for a, b in zip(outs, values))
        blob = await client.get_blob(keys[0])
        await client.put_blob(keys[0].id, [blob])
        assert await client.contains(keys[0])
        assert await client.pin(keys, 5) == 3 and await client.unpin(keys) == 3
        assert isinstance(await client.prefetch(keys), list)
        assert (await client.ping())[0] == "SERVING"
        assert (await client.stats()).chunks >= 3
        assert await client.delete(keys) == 3
        assert await client.get(keys) == []


def test_health_and_reflection_are_served(daemon):
    channel = grpc.insecure_channel(daemon.addr)
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="kvstore.v1.KVStore"), metadata=metadata)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                        metadata=metadata)
    names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"kvstore.v1.KVStore", "grpc.health.v1.Health"} <= names
    channel.close()


def test_every_rpc_needs_the_token(daemon):
    keys, values = chunks(1, seed=13)
    with connect(daemon) as client:
        client.put(keys[0], values[0])
    for kw in ({}, {"token": "wrong"}):
        with Client(daemon.addr, retries=0, **kw) as client:
            for call in (lambda: client.lookup(keys), lambda: client.get(keys), lambda: client.put(keys[0], values[0]),
                         lambda: client.stats(), lambda: client.ping(), lambda: client.delete(keys)):
                with pytest.raises(DaemonError) as info:
                    call()
                assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    channel = grpc.insecure_channel(daemon.addr)  # the standard health service too
    with pytest.raises(grpc.RpcError) as info:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    channel.close()
    # the bulk side channel: a session exists only through an authenticated RPC, and its
    # connection must present that session's one-time token
    with connect(daemon) as client:
        attach = client._drive(client._core._call("BulkAttach", pb.BulkAttachRequest()))
        assert client.contains(keys[0])
    sock = socket.create_connection(("127.0.0.1", attach.port))
    sock.sendall(HELLO.pack(attach.session ^ 1, attach.token))
    assert sock.recv(1) == b""
    assert main(["stats", "--addr", daemon.addr]) == 2  # the CLI: one line, exit 2


def test_kvbench_daemon_quick_mode_reports_medians_of_rounds_and_keeps_every_round(daemon, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert kvbench(["daemon", "--addr", daemon.addr, "--auth-token-file", daemon.token_file, "--chunk-bytes", "64KiB",
                    "--seconds", "0.2", "--keys", "4", "--rounds", "3", "--processes", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rounds = result["rounds"]
    assert len(rounds) == 3
    for path in ("remote", "shm"):
        assert {"put_gbps", "get_gbps", "get_p99_s", "put_p99_s", "get_p50_s"} <= set(result[path])
        for key in ("put_gbps", "get_gbps", "get_one_gbps", "get_p99_s"):  # medians of the rounds, with their spread
            values = [r[path][key] for r in rounds]
            assert result[path][key] == statistics.median(values) > 0
            assert result[path]["spread"][key] == {"median": result[path][key], "min": min(values), "max": max(values)}
    assert result["remote"]["transport"] == "bulk" and result["shm"]["transport"] == "shm"
    for name in ("socket", "memcpy"):  # each round's limit is its best configuration; the figure their median
        limits = [r[f"{name}_limit"] for r in rounds]
        assert all(limit["gbps"] == max(limit["tried"].values()) for limit in limits)
        assert result[f"{name}_gbps"] == statistics.median(limit["gbps"] for limit in limits) > 0
    per_round = [r["shm"]["get_gbps"] / r["memcpy_limit"]["gbps"] for r in rounds]
    assert result["ratios"]["shm_get_vs_memcpy"] == statistics.median(per_round)
    assert result["ratios_spread"]["shm_get_vs_memcpy"]["max"] == max(per_round)
    aggregate = result["aggregate"]["shm"]  # the same worker process got in every round
    assert aggregate["get_gbps"] == statistics.median(r["aggregate_shm"]["get_gbps"] for r in rounds) > 0
    assert aggregate["vs_one_client"] == statistics.median(
        r["aggregate_shm"]["get_gbps"] / r["shm"]["get_gbps"] for r in rounds)
    text = capsys.readouterr().out
    assert "x socket" in text and "3 rounds" in text and "median (min-max)" in text
    assert isinstance(result["over_limit"], list)


def test_kvbench_daemon_flags_each_round_a_path_beats_its_limit(daemon, tmp_path, monkeypatch, capsys):
    """A limit that ours beats proves the limit wrong: every such round is named."""
    from bench import daemon as bench_daemon
    from bench.limits import Limit

    monkeypatch.setattr(bench_daemon, "memcpy_limit", lambda pairs: Limit(1e-6, "too low", {"too low": 1e-6}))
    out = tmp_path / "bench.json"
    assert kvbench(["daemon", "--addr", daemon.addr, "--auth-token-file", daemon.token_file, "--chunk-bytes", "64KiB",
                    "--seconds", "0.1", "--keys", "4", "--rounds", "2", "--json", str(out)]) == 0
    flags = json.loads(out.read_text())["over_limit"]
    for figure in ("shm put", "shm get", "shm get x1"):
        assert sorted(f["round"] for f in flags if f["figure"] == figure) == [0, 1]
    assert not [f for f in flags if f["figure"].startswith("remote")]  # its socket limit was real
    assert capsys.readouterr().out.count("OVER LIMIT round ") == len(flags)


def test_kvbench_daemon_a_failed_client_fails_the_measurement_not_a_figure_of_zero():
    from bench.daemon_paths import measure

    def work(client, i, deadline, latencies):
        raise RuntimeError("a chunk the benchmark stored is missing")

    with pytest.raises(RuntimeError, match="missing"):
        measure([None, None], work, 0.01, None)


@pytest.mark.parametrize("transport", ["shm", "remote"])
def test_one_client_shared_by_threads_stays_bit_exact(daemon, transport):
    ns = Namespace("threads", 2, 2, 64, chunk_tokens=64)  # 64 KiB chunks
    errors = []

    def worker(t, client):
        try:
            keys, values = chunks(6, ns, seed=100 + t)
            for k, v in zip(keys, values):
                client.put(k, v)
            for _ in range(3):
                got = client.get(keys)
                assert len(got) == 6 and all(same(a, b) for a, b in zip(got, values))
                out = torch.empty_like(values[t % 6])
                assert client.get_into(keys[t % 6], out) and same(out, values[t % 6])
        except Exception as exc:  # surfaced below
            errors.append(exc)

    with connect(daemon, transport=transport, shm_slots=3) as client:
        threads = [threading.Thread(target=worker, args=(t, client)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors


def test_a_codec_verdict_holds_for_its_models_chunks_only(tmp_path):
    """The daemon stores a chunk under the namespace its request names, so placement knows its
    model: model A's verdict keeps A's victims int8 and never makes model B's chunks lossy.
    (It used to put by key id alone: no model, so no verdict held for any chunk it stored.)"""
    a = Namespace("model-a", num_layers=2, num_kv_heads=2, head_dim=64, chunk_tokens=16)  # 16 KiB fp16
    b = Namespace("model-b", num_layers=2, num_kv_heads=2, head_dim=64, chunk_tokens=16)
    (tmp_path / "verdicts.json").write_text(json.dumps({
        "schema": "kvstore.codec-verdicts/2", "model": "a", "model_id": a.model_id, "dtype": "float16",
        "codecs": {"int8": {"ppl_change_pct": 0.02, "allowed": True}}}))
    (tmp_path / "daemon.toml").write_text(  # RAM for 8 raw chunks, no disk: dropping a chunk means recomputing it
        f'[shm]\nenabled = false\n[store.host]\ncapacity_bytes = {8 * 5 * 4096}\npage_bytes = 4096\nprefault = false\n'
        f'[store.disk]\nenabled = false\n[store.placement]\ncodecs = ["int8"]\nverdicts = ["{tmp_path / "verdicts.json"}"]\n'
        f'quality_weight_s = 0.0005\nprefill_tokens_per_s = 2000.0\n')
    (tmp_path / "token").write_text(TOKEN + "\n")
    keys_a, values_a = chunks(12, a, seed=1)
    keys_b, values_b = chunks(12, b, seed=2)
    with DaemonProcess(["--config", str(tmp_path / "daemon.toml"), "--listen", "127.0.0.1:0",
                        "--data-dir", str(tmp_path / "data"), "--auth-token-file", str(tmp_path / "token")]) as proc:
        with Client(proc.addr, token=TOKEN) as client:
            for ka, va, kb, vb in zip(keys_a, values_a, keys_b, values_b):
                client.put(ka, va)
                client.put(kb, vb)
            assert client.stats().tiers["host"].recodes > 0  # victims of model A's, the only one with a verdict
            for key, value in zip(keys_b, values_b):
                got = client.get([key])
                assert not got or same(got[0], value), "model B's chunk came back lossy"
