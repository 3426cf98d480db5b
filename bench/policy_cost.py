"""``kvbench policy-cost``: what an eviction policy costs in CPU per access, in the trace
simulator and in the Store's path.

The Store's figure is a replay of a trace's first requests through a Store with only host
RAM (tiny chunks, so the policy's share of the time shows): each block is looked up and, on
a miss, put with its parent. The same replay with LRU, whose bookkeeping is a dict move, is
the baseline; the policy's cost per access is the difference of the two times, divided by
the accesses.
"""

from __future__ import annotations

import hashlib
import sys
import time

import torch

from bench.sim import capacity_blocks, simulate
from bench.traces import load_trace
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.keys import HASH_BYTES, ChunkKey, Namespace
from kvstore.policies import make_policy
from kvstore.store import Store

NS = Namespace("policy-cost", num_layers=1, num_kv_heads=1, head_dim=16, chunk_tokens=8)  # 256-byte chunks
PAGE = 4096


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("policy-cost", help="CPU cost per access of eviction policies (simulator and Store)")
    p.add_argument("--trace", required=True, help="as for `kvbench policies`")
    p.add_argument("--capacity", type=float, default=5.0, help="percent of the distinct blocks (default 5)")
    p.add_argument("--requests", type=int, default=3000, help="requests replayed through the Store (default 3000)")
    p.add_argument("--policies", default="lru,default", help="comma-separated, the first is the baseline")
    p.set_defaults(func=run)


def store_seconds(trace, policy: str, capacity_blocks_: int) -> float:
    """Seconds to replay ``trace`` through a host-RAM-only Store of that many pages."""
    config = StoreConfig(host=HostTierConfig(capacity_bytes=capacity_blocks_ * PAGE, page_bytes=PAGE, prefault=False),
                         disk=DiskTierConfig(enabled=False), replicate_to=[], eviction_policy=policy)
    kv = torch.zeros(NS.chunk_shape, dtype=NS.torch_dtype)
    out = torch.empty_like(kv)
    keys = {}
    with Store(config) as store:
        start = time.perf_counter()
        for request in trace.requests:
            parent = None
            for block in request:
                key = keys.get(block)
                if key is None:
                    key = keys[block] = ChunkKey(NS, hashlib.blake2b(repr(block).encode(), digest_size=HASH_BYTES).digest())
                if not store.get_into(key, out):
                    store.put(key, kv, parent=parent)
                parent = key
        return time.perf_counter() - start


def run(args) -> int:
    trace = load_trace(args.trace)
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    blocks = capacity_blocks(trace, args.capacity)
    head = trace.head(args.requests)
    head_blocks = capacity_blocks(head, args.capacity)
    print(f"{trace.name}: simulator {trace.accesses} accesses at {args.capacity}% ({blocks} blocks); "
          f"Store {head.accesses} accesses of its first {len(head.requests)} requests ({head_blocks} chunks)", file=sys.stderr)
    print("policy  simulator_us/access  store_us/access  store_us/access_minus_the_first")
    base = None
    for name in names:
        start = time.perf_counter()
        simulate(trace, make_policy(name, blocks), blocks)
        sim_us = 1e6 * (time.perf_counter() - start) / trace.accesses
        store_us = 1e6 * store_seconds(head, name, head_blocks) / head.accesses
        base = store_us if base is None else base
        print(f"{name}  {sim_us:.1f}  {store_us:.1f}  {store_us - base:+.1f}", flush=True)
    return 0
