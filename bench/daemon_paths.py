"""``kvbench daemon``'s measurement of one transport: its clients (``--clients``, one thread
each) put, get in batches and get one chunk at a time for ``--seconds``; GB/s, latency
percentiles and the CPU seconds per GB of the clients and of the daemon."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import resource
import threading
import time

import numpy as np

from bench.daemon_credentials import Credential
from bench.limits import GB
from kvstore.client import Client
from kvstore.keys import ChunkKey, Namespace


def cpu_seconds(pid: int | None) -> float:
    """CPU time (user + system) of this process, or of ``pid`` (Linux /proc); 0 if unknown."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _summary(latencies: list[float], nbytes: int, elapsed: float, cpu: tuple[float, float]) -> dict:
    lat = np.array(latencies) if latencies else np.array([float("nan")])
    return {
        "gbps": nbytes / elapsed / GB if elapsed > 0 else 0.0,
        "p50_s": float(np.percentile(lat, 50)),
        "p99_s": float(np.percentile(lat, 99)),
        "ops": len(latencies),
        # CPU seconds per GB moved, clients and daemon: comparable on a busy machine, where
        # wall-clock GB/s depends on what else runs
        "client_cpu_s_per_gb": cpu[0] / (nbytes / GB) if nbytes else 0.0,
        "daemon_cpu_s_per_gb": cpu[1] / (nbytes / GB) if nbytes else 0.0,
    }


def measure(clients: list[Client], work, seconds: float, daemon_pid: int | None) -> dict:
    """Run ``work(client, index, deadline, latencies)`` in one thread per client."""
    latencies: list[list[float]] = [[] for _ in clients]
    done = [0] * len(clients)
    failed: list[BaseException] = []
    barrier = threading.Barrier(len(clients) + 1)

    def worker(i: int) -> None:
        barrier.wait()
        try:
            done[i] = work(clients[i], i, time.perf_counter() + seconds, latencies[i])
        except BaseException as exc:  # raised below: a failed client is no figure of 0 GB/s
            failed.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    cpu0 = (cpu_seconds(None), cpu_seconds(daemon_pid) if daemon_pid else 0.0)
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    cpu = (cpu_seconds(None) - cpu0[0], (cpu_seconds(daemon_pid) - cpu0[1]) if daemon_pid else 0.0)
    if failed:
        raise failed[0]
    return _summary([x for lat in latencies for x in lat], sum(done), elapsed, cpu)


class PathBench:
    """One transport's clients (``--clients``, one thread each), connected once and measured
    in every round: put, batched get, single-chunk get."""

    def __init__(self, addr: str, transport: str, args, ns: Namespace, daemon_pid: int | None,
                 creds: list[Credential]) -> None:
        import torch  # here, not at the top: a mistyped argument or an absent daemon fails without its ~1 s

        self.transport, self.args, self.daemon_pid = transport, args, daemon_pid
        self.clients = []
        for c in creds[: args.clients]:
            self.clients.append(Client(addr, transport=transport, token=c.token, token_file=c.token_file,
                                       timeout_s=60))
        self.ns = [dataclasses.replace(ns, tenant=c.tenant) for c in creds[: args.clients]]
        self.used = self.clients[0].path
        self.keys: list[list[ChunkKey]] = [[] for _ in self.clients]
        self.chunk = torch.randn(ns.chunk_shape).to(torch.float16)
        self.nbytes = self.chunk.numel() * 2
        self.batch = min(args.batch, args.keys)

    def close(self) -> None:
        for c in self.clients:
            c.close()

    def _put(self, r: int):
        def put(client: Client, i: int, deadline: float, lat: list[float]) -> int:
            """Fresh keys only, new in every round (a put of a present key is a no-op in the
            Store); the last ``--keys`` stay for the get phase."""
            n = 0
            while time.perf_counter() < deadline or n < self.args.keys:
                name = f"{self.transport}/{r}/{i}/{n}".encode()
                key = ChunkKey(self.ns[i], hashlib.blake2b(name, digest_size=16).digest())
                t0 = time.perf_counter()
                client.put(key, self.chunk)
                lat.append(time.perf_counter() - t0)
                self.keys[i] = (self.keys[i] + [key])[-self.args.keys :]
                n += 1
            return n * self.nbytes
        return put

    def _get(self, client: Client, i: int, deadline: float, lat: list[float]) -> int:
        import torch

        batch, keys = self.batch, self.keys[i]
        outs = [torch.zeros_like(self.chunk) for _ in range(batch)]  # reused, as a connector's staging buffers
        n = 0
        while time.perf_counter() < deadline:
            start = (n * batch) % (len(keys) - batch + 1)
            t0 = time.perf_counter()
            got = client.get_many_into(keys[start : start + batch], outs)
            lat.append(time.perf_counter() - t0)
            if got != batch:
                raise RuntimeError("a chunk the benchmark stored is missing (host tier too small?)")
            n += 1
        return n * batch * self.nbytes

    def _get_one(self, client: Client, i: int, deadline: float, lat: list[float]) -> int:
        import torch

        out = torch.zeros_like(self.chunk)
        n = 0
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            if not client.get_into(self.keys[i][n % len(self.keys[i])], out):
                raise RuntimeError("a chunk the benchmark stored is missing (host tier too small?)")
            lat.append(time.perf_counter() - t0)
            n += 1
        return n * self.nbytes

    def round(self, r: int) -> dict:
        """The previous round's chunks deleted first (outside the timing): read many times, they
        would outrank this round's fresh puts in the host tier's eviction, which then evicts
        chunks this round is about to get; and so every round starts from the same state."""
        for client, keys in zip(self.clients, self.keys):
            if keys:
                client.delete(keys)
        self.keys = [[] for _ in self.clients]
        seconds = self.args.seconds
        p = measure(self.clients, self._put(r), seconds, self.daemon_pid)
        g = measure(self.clients, self._get, seconds, self.daemon_pid)
        g1 = measure(self.clients, self._get_one, seconds / 2, self.daemon_pid)
        result = {}
        for prefix, figures in (("put", p), ("get", g), ("get_one", g1)):
            result.update({f"{prefix}_{name}": value for name, value in figures.items()})
        return result
