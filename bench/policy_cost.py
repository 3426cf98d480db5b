"""``kvbench policy-cost``: what an eviction policy costs in CPU per access, in the trace
simulator and in the Store's path.

The Store's figure is a replay of a trace's first requests through a Store with only host
RAM (tiny chunks, so the policy's share of the time shows): each block is looked up and, on
a miss, put with its parent. A second run logs every call the Store makes into the tier's
policy (``RecordingPolicy``), and the log replayed against a fresh policy gives the
policy's own share; the rest of the Store's time per access is its bookkeeping around the
policy. Times are CPU time (the process's, background threads included), so a busy
machine inflates them less than it would wall-clock time. The same replay with the first policy named (LRU by
default, whose bookkeeping is a dict move) is the baseline for the difference column; a
policy with more hits makes fewer puts, so that difference also holds the puts it saved.
"""

from __future__ import annotations

import hashlib
import sys
import time
from typing import Hashable

from bench.sim import capacity_blocks, simulate
from bench.traces import load_trace
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.keys import HASH_BYTES, ChunkKey, Namespace
from kvstore.policies import make_policy
from kvstore.policies.base import EvictionPolicy

NS = Namespace("policy-cost", num_layers=1, num_kv_heads=1, head_dim=16, chunk_tokens=8)  # 256-byte chunks
PAGE = 4096


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("policy-cost", help="CPU cost per access of eviction policies (simulator and Store)")
    p.add_argument("--trace", required=True, help="as for `kvbench policies`")
    p.add_argument("--capacity", type=float, default=5.0, help="percent of the distinct blocks (default 5)")
    p.add_argument("--requests", type=int, default=3000, help="requests replayed through the Store (default 3000)")
    p.add_argument("--policies", default="lru,default", help="comma-separated, the first is the baseline")
    p.set_defaults(func=run)


class RecordingPolicy(EvictionPolicy):
    """Forwards every call to ``inner`` and logs it, so the calls can be replayed against a
    fresh policy (``replay_seconds``) and timed apart from the Store."""

    def __init__(self, inner: EvictionPolicy) -> None:
        super().__init__(inner.capacity_bytes)
        self.inner = inner
        self.name = inner.name
        self.calls: list[tuple[str, tuple]] = []

    def on_hit(self, key: Hashable) -> None:
        self.calls.append(("on_hit", (key,)))
        self.inner.on_hit(key)

    def on_miss(self, key: Hashable) -> None:
        self.calls.append(("on_miss", (key,)))
        self.inner.on_miss(key)

    def admit(self, key: Hashable, size: int, parent: Hashable | None = None) -> bool:
        self.calls.append(("admit", (key, size, parent)))
        return self.inner.admit(key, size, parent)

    def on_insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        self.calls.append(("on_insert", (key, size, parent)))
        self.inner.on_insert(key, size, parent)

    def on_remove(self, key: Hashable, held: bool = True) -> None:
        self.calls.append(("on_remove", (key, held)))
        self.inner.on_remove(key, held)

    def evict(self) -> Hashable:
        self.calls.append(("evict", ()))
        return self.inner.evict()

    def reinstate(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        self.calls.append(("reinstate", (key, size, parent)))
        self.inner.reinstate(key, size, parent)

    def reuse_estimate(self, key: Hashable) -> float:
        self.calls.append(("reuse_estimate", (key,)))
        return self.inner.reuse_estimate(key)

    def __len__(self) -> int:
        self.calls.append(("__len__", ()))
        return len(self.inner)

    def __contains__(self, key: Hashable) -> bool:
        self.calls.append(("__contains__", (key,)))
        return key in self.inner


def replay_seconds(policy: str, capacity_bytes: int, calls: list[tuple[str, tuple]]) -> float:
    """CPU seconds a fresh ``policy`` takes to answer ``calls`` (a deterministic policy makes
    the same decisions as when they were logged); the replay loop's own cost is included."""
    fresh = make_policy(policy, capacity_bytes)
    methods = {name: getattr(fresh, name) for name in {name for name, _ in calls}}
    log = [(methods[name], args) for name, args in calls]
    start = time.process_time()
    for method, args in log:
        method(*args)
    return time.process_time() - start


def _replay_store(trace, config: StoreConfig, wrap=None) -> float:
    """CPU seconds (the process's, background threads included) to replay ``trace`` through
    a Store: each block looked up and, on a miss, put with its parent."""
    import torch  # here, not at the top: --help and a mistyped argument go without its seconds

    from kvstore.store import Store

    kv = torch.zeros(NS.chunk_shape, dtype=NS.torch_dtype)
    out = torch.empty_like(kv)
    keys = {}
    with Store(config) as store:
        if wrap is not None:
            store.index.policies.update({name: wrap(p) for name, p in store.index.policies.items()})
        start = time.process_time()
        for request in trace.requests:
            parent = None
            for block in request:
                key = keys.get(block)
                if key is None:
                    key = keys[block] = ChunkKey(NS, hashlib.blake2b(repr(block).encode(), digest_size=HASH_BYTES).digest())
                if not store.get_into(key, out):
                    store.put(key, kv, parent=parent)
                parent = key
        return time.process_time() - start


def store_seconds(trace, policy: str, capacity_blocks_: int) -> tuple[float, float]:
    """CPU seconds to replay ``trace`` through a host-RAM-only Store of that many pages, and
    how many of them the policy's own calls take (logged in a second run, then replayed
    against a fresh policy)."""
    config = StoreConfig(host=HostTierConfig(capacity_bytes=capacity_blocks_ * PAGE, page_bytes=PAGE, prefault=False),
                         disk=DiskTierConfig(enabled=False), replicate_to=[], eviction_policy=policy)
    total = _replay_store(trace, config)
    recorders: list[RecordingPolicy] = []

    def record(p: EvictionPolicy) -> RecordingPolicy:
        recorders.append(RecordingPolicy(p))
        return recorders[-1]

    _replay_store(trace, config, record)
    return total, sum(replay_seconds(policy, r.capacity_bytes, r.calls) for r in recorders)


def run(args) -> int:
    trace = load_trace(args.trace)
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    blocks = capacity_blocks(trace, args.capacity)
    head = trace.head(args.requests)
    head_blocks = capacity_blocks(head, args.capacity)
    print(f"{trace.name}: simulator {trace.accesses} accesses at {args.capacity}% ({blocks} blocks); "
          f"Store {head.accesses} accesses of its first {len(head.requests)} requests ({head_blocks} chunks)", file=sys.stderr)
    print("policy  simulator_us/access  store_us/access  store_policy_us/access  store_rest_us/access  store_us/access_minus_the_first")
    base = None
    for name in names:
        start = time.process_time()
        simulate(trace, make_policy(name, blocks), blocks)
        sim_us = 1e6 * (time.process_time() - start) / trace.accesses
        total, inside = store_seconds(head, name, head_blocks)
        store_us, policy_us = 1e6 * total / head.accesses, 1e6 * inside / head.accesses
        base = store_us if base is None else base
        print(f"{name}  {sim_us:.1f}  {store_us:.1f}  {policy_us:.1f}  {store_us - policy_us:.1f}  {store_us - base:+.1f}", flush=True)
    return 0
