"""The machine's limits every ``kvbench`` figure is compared against, each the best of the
configurations tried, with the configuration that gave it.

- memcpy: the same (destination, source) buffers a benchmark moves, copied one thread of
  ``np.copyto``, a persistent pool of k threads of ``memmove`` over slices (k = 2 .. cores),
  and torch's threaded ``copy_``.
- disk: the same files read whole, buffered (in one call per file, or in 256 KiB calls, which
  let the kernel's readahead overlap the copies) and O_DIRECT, 1, 2, 4 and 8 files in flight, each
  run with the page cache dropped (fdatasync + POSIX_FADV_DONTNEED) and checked dropped
  (``mincore`` over a mapping of each file); a file still cached fails the measurement.
- socket: loopback TCP, 1 to 4 streams at once, out of as many distinct buffers as a benchmark's
  get reads and into as many as it fills.

A figure of ours more than ``NOISE`` above its limit means the limit is wrong (``over_limit``;
per round of interleaved rounds, ``bench/rounds.over_limit``).
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from kernels.parallel_copy import split
from tiers.read_probe import INFLIGHT, cached_bytes, direct_supported, drop_cache, read_all, read_buffers

GB = 1e9
NOISE = 0.05
REPEAT = 3  # timings of each configuration of a limit, and of ours where it can be made again
STREAMS = (1, 2, 3, 4)
SLICE_READ_BYTES = 256 << 10  # reads of this size keep the kernel's readahead ahead of the copies


@dataclass
class Limit:
    gbps: float
    config: str  # the configuration that gave it
    tried: dict[str, float] = field(default_factory=dict)  # every configuration's GB/s

    def as_dict(self) -> dict:
        return {"gbps": self.gbps, "config": self.config, "tried": self.tried}


def best_of(tried: dict[str, float]) -> Limit:
    """The best configuration's figure as the limit."""
    if not tried:
        raise ValueError("no configuration was measured")
    config = max(tried, key=tried.get)
    return Limit(tried[config], config, dict(tried))


def best_over(limits: Sequence[Limit]) -> Limit:
    """One limit measured at several moments of a run (a shared disk's speed drifts over
    minutes): each configuration's best figure across them, and the best of those."""
    tried: dict[str, float] = {}
    for limit in limits:
        for config, gbps in limit.tried.items():
            tried[config] = max(tried.get(config, 0.0), gbps)
    return best_of(tried)


def over_limit(figures: dict[str, float], limit: Limit) -> list[str]:
    """The named figures above the limit by more than noise: each proves the limit too low."""
    return [f"{name} {gbps:.2f} GB/s exceeds the {limit.config} limit {limit.gbps:.2f} GB/s by more than "
            f"{NOISE:.0%}: that limit is not the machine's" for name, gbps in figures.items()
            if gbps > limit.gbps * (1 + NOISE)]


def best_time(fn: Callable[[], None], repeat: int = REPEAT) -> float:
    """The shortest of ``repeat`` timings of ``fn()`` (seconds). A limit's configurations are
    timed so, and the figures of ours that can be measured again are too: one timing of ours
    against the best of several of its limit would read a hiccup of the machine as ours
    being slow (three copies of the same 270 MB in a row: 17.0, 4.7 and 25.2 GB/s)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


# -- memcpy -------------------------------------------------------------------------------------

def _memmove(dst: np.ndarray, src: np.ndarray) -> None:
    ctypes.memmove(dst.ctypes.data, src.ctypes.data, src.size)  # ctypes releases the GIL


def memcpy_limit(pairs: Sequence[tuple[np.ndarray, np.ndarray]], repeat: int = REPEAT) -> Limit:
    """Best GB/s copying every ``src`` into its ``dst`` (uint8 arrays), in order, per config."""
    pairs = list(pairs)
    total = sum(src.size for _, src in pairs)
    cores = os.cpu_count() or 1
    tried: dict[str, float] = {}

    def single() -> None:
        for dst, src in pairs:
            np.copyto(dst, src)

    tried["np.copyto, 1 thread"] = total / best_time(single, repeat) / GB
    for k in range(2, max(2, cores) + 1):
        with ThreadPoolExecutor(k - 1) as pool:
            per_pair = [split([(dst, src)], k) for dst, src in pairs]

            def threaded() -> None:
                for groups in per_pair:
                    futures = [pool.submit(lambda g=g: [_memmove(d, s) for d, s in g]) for g in groups[1:]]
                    for d, s in groups[0]:
                        _memmove(d, s)
                    for f in futures:
                        f.result()

            threaded()  # the pool's threads start outside the timing
            tried[f"memmove over slices, {k} threads"] = total / best_time(threaded, repeat) / GB
    import torch  # here: the CLI imports subcommand modules without torch

    tensors = [(torch.from_numpy(dst), torch.from_numpy(src)) for dst, src in pairs]

    def torch_copy() -> None:
        for dst, src in tensors:
            dst.copy_(src)

    tried[f"torch copy_, {torch.get_num_threads()} threads"] = total / best_time(torch_copy, repeat) / GB
    return best_of(tried)


# -- disk (the page-cache tools are tiers/read_probe.py's, which sizes the disk tier's reads) ----

def disk_read_limit(paths: Sequence[str], repeat: int = 1, inflight: Sequence[int] = INFLIGHT) -> Limit:
    """Best GB/s reading the files whole, cold, per (buffered | O_DIRECT) x reads in flight."""
    paths = list(paths)
    total = sum(os.path.getsize(p) for p in paths)
    modes = [("buffered", False, None), (f"buffered in {SLICE_READ_BYTES >> 10} KiB reads", False, SLICE_READ_BYTES)]
    modes += [("O_DIRECT", True, None)] if direct_supported(paths[0]) else []
    tried: dict[str, float] = {}
    # made and touched once, outside the timing, as ours read into pre-touched buffers
    buffers = read_buffers(paths, max(inflight))
    for name, direct, read_bytes in modes:
        for n in inflight:
            best = float("inf")
            for _ in range(repeat):
                drop_cache(paths)
                t = time.perf_counter()
                read_all(paths, n, direct, read_bytes, buffers)
                best = min(best, time.perf_counter() - t)
            tried[f"{name}, {n} in flight"] = total / best / GB
    return best_of(tried)


# -- socket -------------------------------------------------------------------------------------

def socket_gbps(chunk_bytes: int, seconds: float, streams: int, sources: int, destinations: int) -> float:
    """Raw loopback TCP: ``streams`` connections at once, each sending chunk after chunk out of
    its share of ``sources`` distinct buffers and receiving them into its share of
    ``destinations`` reused ones (at least one each): as many as a benchmark's get moves
    between, so as cold in cache (one buffer sent again and again stays in the cache and
    read 20-40% faster than the 16 chunks a client cycles over)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = time.perf_counter() + seconds
    received = [0] * streams

    def buffers(count: int, fill: int) -> list[memoryview]:
        return [memoryview(np.full(chunk_bytes, fill, dtype=np.uint8)) for _ in range(max(1, count // streams))]

    def sender(conn: socket.socket) -> None:
        data = buffers(sources, 1)
        try:
            n = 0
            while time.perf_counter() < stop:
                conn.sendall(data[n % len(data)])
                n += 1
        except OSError:
            pass
        finally:
            conn.close()

    def receiver(i: int) -> None:
        s = socket.create_connection(("127.0.0.1", port))
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            s.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
        bufs, n, filled = buffers(destinations, 0), 0, 0
        while True:
            got = s.recv_into(bufs[n][filled:])
            if got == 0:
                break
            received[i] += got
            filled += got
            if filled == chunk_bytes:
                n, filled = (n + 1) % len(bufs), 0
        s.close()

    receivers = [threading.Thread(target=receiver, args=(i,)) for i in range(streams)]
    senders = []
    start = time.perf_counter()
    for r in receivers:
        r.start()
        conn, _ = listener.accept()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        senders.append(threading.Thread(target=sender, args=(conn,)))
        senders[-1].start()
    for t in senders + receivers:
        t.join()
    listener.close()
    return sum(received) / (time.perf_counter() - start) / GB


def socket_limit(chunk_bytes: int, seconds: float, sources: int, destinations: int,
                 streams: Sequence[int] = STREAMS) -> Limit:
    """Best GB/s of loopback TCP over 1 to 4 streams, ``seconds`` each, moving chunks out of
    ``sources`` distinct buffers into ``destinations`` reused ones (``socket_gbps``)."""
    return best_of({f"{n} stream{'s' * (n > 1)}": socket_gbps(chunk_bytes, seconds, n, sources, destinations)
                    for n in streams})
