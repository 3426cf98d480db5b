"""Fairness: a well-behaved tenant's service alone, then beside each abusive pattern of another
tenant (issue 36), with the health check asked throughout.

The victim puts and gets its own 16 KiB chunks in a loop (a put, then a get of it: P50/P99
latency of each, operations per second, refusals). The attacker, with a host quota of 1 MiB,
meanwhile runs one pattern: idle Put streams, bulk frames whose body it withholds, tiny chunks
it pins, its disk chunks read back and pinned, Pause floods and Contains floods of random
keys, Gets and Puts in one-byte pieces. Each pattern's report says the victim's slowdown
(its P99 against its P99 alone), its refusals, the health checks that failed, the
attacker's requests refused, the victim's slowest operation, and the daemon's RSS before and
after.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.attacks.target import NS, TOKENS, Target, content, keys, rss_bytes
from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.wire._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client import Client, DaemonError
from kvstore.keys import Namespace, chunk_keys
from kvstore.wire.convert import ns_to_proto
from kvstore.wire.frames import ERROR, FRAME, HELLO, PUT

# what the target runs with: the attacker's host quota, a tenant's in-flight bytes
TENANT_EXTRA = {"attacker": 'host_bytes = "1MiB"\n'}
LIMITS = '[limits]\nmax_bytes_in_flight_per_tenant = "64MiB"\n'
TINY = Namespace("fairness-tiny", 1, 1, 8, chunk_tokens=8)  # 256-byte chunks: a 4 KiB page each


@dataclass
class Phase:
    """What the victim saw during one phase, and what the attacker got."""

    put_ms: list[float] = field(default_factory=list)
    get_ms: list[float] = field(default_factory=list)
    victim_refused: int = 0
    health_failed: int = 0
    health_asked: int = 0
    health_errors: Counter = field(default_factory=Counter)  # status code names
    attacker_refused: int = 0
    attacker_served: int = 0
    rss_before: int = 0
    rss_after: int = 0
    seconds: float = 0.0

    def as_dict(self, alone: "Phase | None" = None) -> dict:
        p99 = _percentile(self.put_ms + self.get_ms, 99)
        out = {
            "put_p50_ms": _percentile(self.put_ms, 50), "put_p99_ms": _percentile(self.put_ms, 99),
            "get_p50_ms": _percentile(self.get_ms, 50), "get_p99_ms": _percentile(self.get_ms, 99),
            "max_ms": round(max(self.put_ms + self.get_ms, default=0.0), 2),
            "ops_per_s": round(len(self.put_ms + self.get_ms) / self.seconds, 1) if self.seconds else 0.0,
            "victim_refused": self.victim_refused, "health_failed": self.health_failed,
            "health_asked": self.health_asked, "health_errors": dict(self.health_errors), "attacker_refused": self.attacker_refused,
            "attacker_served": self.attacker_served, "rss_before_mb": round(self.rss_before / 2**20, 1),
            "rss_after_mb": round(self.rss_after / 2**20, 1),
        }
        if alone is not None:
            base = _percentile(alone.put_ms + alone.get_ms, 99)
            out["p99_slowdown"] = round(p99 / base, 2) if base else None
        return out


def _percentile(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 2) if values else 0.0


def run(target: Target, seconds: float, control: Target | None = None) -> dict:
    """The victim alone, then beside each pattern, ``seconds`` each; a report per phase. With
    a ``control`` daemon, each pattern runs a second time aimed at it while the victim
    measures ``target``: its ``control_p99_slowdown`` is what the attacker's work does to the
    victim through the machine alone (its cores, shared by the clients and the daemons), the
    part of ``p99_slowdown`` no daemon could take away."""
    reports = {}
    alone = _phase(target, seconds, None)
    reports["alone"] = alone.as_dict()
    for pattern in PATTERNS:
        reports[pattern] = _phase(target, seconds, pattern).as_dict(alone)
        if control is not None:
            reports[pattern]["control_p99_slowdown"] = _phase(target, seconds, pattern, control).as_dict(alone)[
                "p99_slowdown"]
    reports["victim_bad"] = target.intact()
    return reports


def _phase(target: Target, seconds: float, pattern: str | None, attacked: Target | None = None) -> Phase:
    """The victim measures ``target``; the attacker runs ``pattern`` against ``attacked``
    (``target`` unless given), in a process of its own (in this one, its Python work would take
    the victim client's interpreter lock and count as the daemon's slowness)."""
    attacked = attacked or target
    phase = Phase(rss_before=rss_bytes(target.pid))
    stop = threading.Event()
    probe = threading.Thread(target=_probe, args=(target, stop, phase), daemon=True)
    probe.start()
    attacker = None
    if pattern is not None:
        spawn = multiprocessing.get_context("spawn")
        ready, done, results = spawn.Event(), spawn.Event(), spawn.Queue()
        attacker = spawn.Process(target=_attack, args=(attacked.addr, pattern, ready, done, results), daemon=True)
        attacker.start()
        if not ready.wait(120):
            raise RuntimeError(f"the {pattern} attacker did not start")
    time.sleep(min(1.0, seconds / 4))  # a warm-up: the attack under way before the victim measures
    _victim(target, seconds, phase)
    stop.set()
    probe.join(60)
    if attacker is not None:
        done.set()
        phase.attacker_refused, phase.attacker_served = results.get(timeout=120)
        attacker.join(60)
    phase.rss_after = rss_bytes(target.pid)
    return phase


def _victim(target: Target, seconds: float, phase: Phase) -> None:
    mine = keys(10_000, 64)
    with target.client("victim", transport="remote", retries=0, timeout_s=30) as client:
        start = time.perf_counter()
        i = 0
        while time.perf_counter() - start < seconds:
            k = mine[i % len(mine)]
            try:
                t0 = time.perf_counter()
                client.put(k, content(i % 64))
                t1 = time.perf_counter()
                got = client.get([k])
                t2 = time.perf_counter()
                phase.put_ms.append((t1 - t0) * 1000)
                phase.get_ms.append((t2 - t1) * 1000)
                if len(got) != 1:
                    phase.victim_refused += 1
            except DaemonError:
                phase.victim_refused += 1
            i += 1
        phase.seconds = time.perf_counter() - start


def _probe(target: Target, stop: threading.Event, phase: Phase) -> None:
    """Ask the health service every 100 ms, as an orchestrator's probe would."""
    channel = _own_connection(target)
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        while not stop.wait(0.1):
            phase.health_asked += 1
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2, metadata=_auth("victim"))
                phase.health_failed += reply.status != health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError as exc:
                phase.health_failed += 1
                phase.health_errors[exc.code().name] += 1
    finally:
        channel.close()


def _own_connection(target) -> grpc.Channel:
    """A channel on a TCP connection of its own, as another process's would be: channels of one
    process with the same arguments share one, and the probe's health checks then queued
    behind the attacker's streams on its connection (HTTP/2 streams are capped per connection)."""
    return grpc.insecure_channel(target.addr, options=[("grpc.use_local_subchannel_pool", 1)])


def _auth(tenant: str):
    return (("authorization", f"Bearer {TOKENS[tenant]}"),)


class _Remote:
    """The daemon as the attacker process knows it: its address."""

    def __init__(self, addr: str) -> None:
        self.addr = addr

    def client(self, tenant: str, **kw) -> Client:
        return Client(self.addr, token=TOKENS[tenant], **kw)


def _attack(addr: str, pattern: str, ready, done, results) -> None:
    """The attacker process: ``pattern`` until ``done``; puts (refused, served) on ``results``."""
    remote, phase = _Remote(addr), Phase()
    channel = _own_connection(remote)
    stub = pb_grpc.KVStoreStub(channel)
    ready.set()
    try:
        PATTERNS[pattern](remote, stub, done, phase)
    finally:
        channel.close()
        results.put((phase.attacker_refused, phase.attacker_served))


def _count(phase: Phase, call) -> None:
    try:
        call()
        phase.attacker_served += 1
    except (grpc.RpcError, DaemonError):
        phase.attacker_refused += 1


def _idle_streams(target, stub, stop, phase) -> None:
    def nothing():
        stop.wait()
        return
        yield

    calls = [stub.Put.future(nothing(), metadata=_auth("attacker")) for _ in range(300)]
    stop.wait()
    for c in calls:
        c.cancel()
    phase.attacker_refused = sum(1 for c in calls if c.done() and not c.cancelled() and c.exception() is not None)


def _withheld_frames(target, stub, stop, phase) -> None:
    size, socks = 16 << 20, []
    meta = pb.PutHeader(blob_bytes=size).SerializeToString()
    try:
        for _ in range(16):
            try:
                reply = stub.BulkAttach(pb.BulkAttachRequest(), metadata=_auth("attacker"), timeout=10)
            except grpc.RpcError:
                phase.attacker_refused += 1
                continue
            sock = socket.create_connection(("127.0.0.1", reply.port), timeout=30)
            socks.append(sock)
            sock.sendall(HELLO.pack(reply.session, reply.token))
            sock.recv(1)
            sock.sendall(FRAME.pack(PUT, len(meta), size) + meta + os.urandom(1 << 16) * ((size - 1) >> 16))
            sock.sendall(b"\0" * ((size - 1) & 0xFFFF))
        for sock in socks:  # a refused frame is answered at once; an admitted one waits for its last byte
            sock.settimeout(1.0)
            try:
                kind = FRAME.unpack(sock.recv(FRAME.size, socket.MSG_WAITALL))[0]
            except (TimeoutError, OSError, struct.error):
                kind = None
            if kind == ERROR:
                phase.attacker_refused += 1
            else:
                phase.attacker_served += 1
        stop.wait()
    finally:
        for sock in socks:
            sock.close()


def _tiny_pinned(target, stub, stop, phase) -> None:
    with target.client("attacker", retries=0, timeout_s=30) as attacker:
        n = 0
        while not stop.is_set():
            batch = chunk_keys(list(range(n * 8, (n + 64) * 8)), TINY)
            n += 64
            for k in batch:
                _count(phase, lambda: attacker.put(k, torch.full(TINY.chunk_shape, 1.0, dtype=torch.float16)))
            _count(phase, lambda: attacker.pin(batch, 300.0))


def _promote_and_pin(target, stub, stop, phase) -> None:
    theirs = keys(20_000, 256)
    with target.client("attacker", retries=0, timeout_s=30) as attacker:
        for i, k in enumerate(theirs):
            if stop.is_set():
                return
            _count(phase, lambda: attacker.put(k, content(i), durable=True))
        while not stop.is_set():
            for start in range(0, len(theirs), 64):
                batch = theirs[start : start + 64]
                _count(phase, lambda: attacker.get(batch))
                _count(phase, lambda: attacker.pin(batch, 300.0))


def _pause_flood(target, stub, stop, phase) -> None:
    rng = np.random.default_rng(1)
    spec = ns_to_proto(NS)
    n = 0
    while not stop.is_set():
        hashes = [bytes(h) for h in rng.integers(0, 256, (4096, 16), dtype=np.uint8)]
        request = pb.PauseRequest(namespace=spec, prefix_hashes=hashes, session=f"s{n}", ttl_s=600.0)
        _count(phase, lambda: stub.Pause(request, metadata=_auth("attacker"), timeout=30))
        n += 1


def _contains_flood(target, stub, stop, phase) -> None:
    """Contains of 4,096 random keys, back to back: each key is bound and looked up apart."""
    rng = np.random.default_rng(2)
    spec = ns_to_proto(NS)
    while not stop.is_set():
        hashes = [bytes(h) for h in rng.integers(0, 256, (4096, 16), dtype=np.uint8)]
        request = pb.KeysRequest(namespace=spec, prefix_hashes=hashes)
        _count(phase, lambda: stub.Contains(request, metadata=_auth("attacker"), timeout=30))


def _one_byte_pieces(target, stub, stop, phase) -> None:
    key = keys(30_000, 1)[0]
    with target.client("attacker", retries=0, timeout_s=30) as attacker:
        attacker.put(key, content(0))
        blob = attacker.get_blob(key)
    spec = ns_to_proto(NS)
    header = pb.PutHeader(namespace=spec, prefix_hash=key.prefix_hash, blob_bytes=len(blob))
    pieces = [pb.PutRequest(header=header)] + [pb.PutRequest(data=blob[i : i + 1]) for i in range(len(blob))]
    request = pb.GetRequest(namespace=spec, prefix_hashes=[key.prefix_hash], payload=pb.BLOB, piece_bytes=1)
    while not stop.is_set():
        _count(phase, lambda: list(stub.Get(request, metadata=_auth("attacker"), timeout=60)))
        _count(phase, lambda: stub.Put(iter(pieces), metadata=_auth("attacker"), timeout=60))


PATTERNS = {"idle_streams": _idle_streams, "withheld_frames": _withheld_frames, "tiny_pinned": _tiny_pinned,
            "promote_and_pin": _promote_and_pin, "pause_flood": _pause_flood, "contains_flood": _contains_flood,
            "one_byte_pieces": _one_byte_pieces}
