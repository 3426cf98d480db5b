"""A discrete-event model of a cluster of inference nodes loading KV prefixes, for
``kvbench cluster-model``: what free-tier fetching over shared tiers gains against a
node-local cache (LMCache-like) as nodes and load grow, and when the gain vanishes.

What is modelled, per node: a GPU that prefills (one request at a time, FIFO, at
``prefill_tokens_per_s``), host RAM, a local disk, and the node's links to the shared tiers
(a PFS and Redis). Each of a node's tiers is one server moving one chunk at a time at its
bandwidth, as the store's throttled fetch workers do (two in flight share one rate); it
serves the earliest requests loading at once in turn (``ClusterSpec.window``). A
shared medium (the PFS, Redis) has an aggregate bandwidth split evenly between the
transfers in flight on it (processor sharing, water-filled under each link's own cap).

A request arrives at a node with a prefix of ``chunks`` chunks that node ``writer`` stored
(or nobody: a new prefix, recomputed by both systems). Ours: the prefix is on the writer's
disk, the PFS and Redis; whichever of the node's reachable tiers is idle claims the next
chunk it can serve of a request on that node (free-tier fetching); the local
disk is reachable only where the node is the writer. Local-only: the prefix is on the
writer's disk alone, so another node's prefix is recomputed. A prefix in the node's host
RAM (probability ``host_hit``) loads from there in both systems. A request's load ends when
its last chunk lands; then it queues for the GPU to compute what was not loaded (the last
token at least); TTFT is then minus the arrival.

Not modelled: decode, writes (puts are assumed behind and off the read path), CPU limits,
per-chunk software overheads (the validation against ``kvbench cluster`` shows what they cost).
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Callable

SHARED_TIERS = ("pfs", "redis")


@dataclass
class ClusterSpec:
    """Bandwidths in bytes/s; a shared tier's ``aggregate`` of 0 means unlimited."""

    nodes: int
    chunk_bytes: int
    chunk_tokens: int
    prefill_tokens_per_s: float
    host_bps: float = 20e9
    disk_bps: float = 3e9
    pfs_link_bps: float = 12.5e9
    pfs_aggregate_bps: float = 100e9
    redis_link_bps: float = 2.5e9
    redis_aggregate_bps: float = 20e9
    shared: tuple[str, ...] = SHARED_TIERS  # the shared tiers ours reads from
    # How a node's tier picks among the requests loading at once: of the ``window`` earliest
    # (0: all), the one that has claimed fewest chunks. 1 is earliest-first; 0 is processor
    # sharing, what the daemon's Gets saw before its read grants; the daemon now keeps the
    # reads of about io_threads / get_read_ahead = 8 / 3 earliest Gets in flight: 3.
    window: int = 3


@dataclass
class Request:
    arrival: float
    node: int
    chunks: int  # prefix chunks that may be loaded
    new_tokens: int  # tokens after the prefix, always computed
    writer: int | None  # the node that stored the prefix; None: nobody (a new prefix)
    in_host: bool = False
    # filled in by the model
    claimed: int = 0
    landed: int = 0
    load_done: float = 0.0
    ttft: float = 0.0
    tiers_used: dict[str, int] = field(default_factory=dict)


class _Events:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._seq = 0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn))

    def run(self) -> None:
        while self._heap:
            self.now, _, fn = heapq.heappop(self._heap)
            fn()


class _Medium:
    """Bytes moving at once over one medium: each transfer at most ``cap`` (a link), together
    at most ``aggregate`` (0: no limit), shared evenly. Every transfer on a medium has the
    same cap, so all move at one rate; a transfer ends when the medium's virtual work (bytes
    each transfer has moved since the start) passes its start's plus its size, which keeps
    one pending event per medium whatever the number of transfers."""

    def __init__(self, events: _Events, cap: float, aggregate: float) -> None:
        self.events, self.cap, self.aggregate = events, cap, aggregate
        self.work = 0.0  # virtual work done by then
        self._at = 0.0
        self._ends: list = []  # (virtual work at the end, id, done callback)
        self._ids = 0
        self._version = 0

    def _rate(self) -> float:
        n = len(self._ends)
        return self.cap if self.aggregate <= 0 or n == 0 else min(self.cap, self.aggregate / n)

    def _advance(self) -> None:
        now = self.events.now
        if self._ends:
            self.work += self._rate() * (now - self._at)
        self._at = now

    def start(self, nbytes: float, done: Callable[[], None]) -> None:
        self._advance()
        self._ids += 1
        heapq.heappush(self._ends, (self.work + nbytes, self._ids, done))
        self._schedule()

    def _schedule(self) -> None:
        self._version += 1
        if self._ends:
            version = self._version
            when = self.events.now + max(0.0, self._ends[0][0] - self.work) / self._rate()
            self.events.at(when, lambda: self._finish(version))

    def _finish(self, version: int) -> None:
        if version != self._version:
            return  # the rate changed since: a later event stands for this one
        self._advance()
        done = []
        slack = self._rate() * 1e-9  # bytes within a nanosecond of the end (float rounding)
        while self._ends and self._ends[0][0] - self.work <= slack:
            done.append(heapq.heappop(self._ends)[2])
        self._schedule()
        for fn in done:
            fn()


class _Fifo:
    """One server doing jobs one at a time in the order they come (a node's GPU)."""

    def __init__(self, events: _Events) -> None:
        self.events, self.free_at = events, 0.0

    def run(self, seconds: float, done: Callable[[float], None]) -> None:
        end = self.free_at = max(self.events.now, self.free_at) + seconds
        self.events.at(end, lambda: done(end))


def simulate(spec: ClusterSpec, requests: list[Request], system: str) -> list[Request]:
    """Run ``requests`` through the cluster as ``system`` ("ours" or "local_only"); each
    request's ``ttft`` and ``load_done`` are filled in. Returns the requests."""
    if system not in ("ours", "local_only"):
        raise ValueError(f"system must be ours or local_only, got {system!r}")
    if spec.window < 0:
        raise ValueError(f"window must be 0 (all) or positive, got {spec.window}")
    events = _Events()
    media = {"pfs": _Medium(events, spec.pfs_link_bps, spec.pfs_aggregate_bps),
             "redis": _Medium(events, spec.redis_link_bps, spec.redis_aggregate_bps)}
    local_media = [{"host": _Medium(events, spec.host_bps, 0), "disk": _Medium(events, spec.disk_bps, 0)}
                   for _ in range(spec.nodes)]
    gpus = [_Fifo(events) for _ in range(spec.nodes)]
    waiting: list[list[Request]] = [[] for _ in range(spec.nodes)]  # loading, by arrival
    busy: list[set[str]] = [set() for _ in range(spec.nodes)]

    def reachable(r: Request) -> tuple[str, ...]:
        if r.in_host:
            return ("host",)
        if r.writer is None:
            return ()
        own = ("disk",) if r.writer == r.node else ()
        return own + (spec.shared if system == "ours" else ())

    def computed_tokens(r: Request) -> int:
        loaded = r.chunks if reachable(r) else 0
        return (r.chunks - loaded) * spec.chunk_tokens + max(1, r.new_tokens)

    def to_gpu(r: Request) -> None:
        r.load_done = events.now

        def done(t: float) -> None:
            r.ttft = t - r.arrival

        gpus[r.node].run(computed_tokens(r) / spec.prefill_tokens_per_s, done)

    def dispatch(node: int) -> None:
        for tier in ("host", "disk") + SHARED_TIERS:
            if tier in busy[node]:
                continue
            candidates = [r for r in waiting[node] if r.claimed < r.chunks and tier in reachable(r)]
            if not candidates:
                continue
            r = min(candidates[: spec.window or None], key=lambda r: r.claimed)
            r.claimed += 1
            r.tiers_used[tier] = r.tiers_used.get(tier, 0) + 1
            busy[node].add(tier)
            medium = media[tier] if tier in media else local_media[node][tier]
            medium.start(spec.chunk_bytes, lambda node=node, tier=tier, r=r: landed(node, tier, r))

    def landed(node: int, tier: str, r: Request) -> None:
        busy[node].discard(tier)
        r.landed += 1
        if r.landed == r.chunks:
            waiting[node].remove(r)
            to_gpu(r)
        dispatch(node)

    def arrive(r: Request) -> None:
        if r.chunks == 0 or not reachable(r):
            to_gpu(r)
            return
        waiting[r.node].append(r)
        dispatch(r.node)

    for r in requests:
        r.claimed = r.landed = 0
        r.tiers_used = {}
        events.at(r.arrival, lambda r=r: arrive(r))
    events.run()
    return requests


def copy_requests(requests: list[Request]) -> list[Request]:
    return [Request(r.arrival, r.node, r.chunks, r.new_tokens, r.writer, r.in_host) for r in requests]


def summary(requests: list[Request]) -> dict:
    ttfts = sorted(r.ttft for r in requests)
    start = min(r.arrival for r in requests)
    end = max(r.arrival + r.ttft for r in requests)

    def pct(p: float) -> float:
        return ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))]

    return {"ttft_mean_s": sum(ttfts) / len(ttfts), "ttft_p90_s": pct(0.90), "ttft_p99_s": pct(0.99),
            "makespan_s": end - start, "requests_per_s": len(requests) / (end - start) if end > start else math.inf}


def workload(spec: ClusterSpec, requests_per_node: int, rate_per_node: float, prefix_chunks: tuple[int, int],
             new_tokens: int, reuse: float, affinity: float | None, host_hit: float, seed: int) -> list[Request]:
    """Poisson arrivals at ``rate_per_node`` requests/s on every node (0: all at once, an
    offline batch). A request reuses a stored prefix with probability ``reuse``, written by
    its own node with probability ``affinity`` (None: 1/N, i.e. routing that ignores where
    prefixes are) and by another node otherwise; a reused prefix is in the node's host RAM
    with probability ``host_hit``."""
    if 0 < rate_per_node < 1e-6:
        raise ValueError(f"a load of {rate_per_node} requests/s spreads arrivals over more than 10^6 s a request")
    rng = random.Random(seed)
    own = 1.0 / spec.nodes if affinity is None else affinity
    out = []
    for node in range(spec.nodes):
        t = 0.0
        for _ in range(requests_per_node):
            if rate_per_node > 0:
                t += rng.expovariate(rate_per_node)
            chunks = rng.randint(*prefix_chunks)
            if rng.random() >= reuse:
                out.append(Request(t, node, chunks, new_tokens, None))
                continue
            if spec.nodes == 1 or rng.random() < own:
                writer = node
            else:
                writer = rng.choice([n for n in range(spec.nodes) if n != node])
            out.append(Request(t, node, chunks, new_tokens, writer, rng.random() < host_hit))
    return out
