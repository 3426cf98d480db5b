"""A store on pages of 4 KiB with placement (re-encoding copies as int8) and a disk tier
that fills up: chunks of 16 KiB fp16, five pages raw, three as int8."""

from __future__ import annotations

import json

import torch

from faults import FaultyTier
from helpers import PAGE
from kvstore.config import DiskTierConfig, HostTierConfig, PlacementConfig, StoreConfig, WriteBehindConfig
from kvstore.keys import Namespace, chunk_keys
from tiers.disk import DiskTier

PLACED_NS = Namespace("placed", num_layers=2, num_kv_heads=2, head_dim=64, chunk_tokens=16)  # 16 KiB fp16 chunks
RAW_UNITS = 5  # a raw blob's 4 KiB units; int8's take 3


def chunks(n: int, seed: int = 0):
    """``n`` keys of one prefix in PLACED_NS and a random chunk for each."""
    gen = torch.Generator().manual_seed(seed)
    keys = chunk_keys(torch.randint(0, 50_000, (n * PLACED_NS.chunk_tokens,), generator=gen).tolist(), PLACED_NS)
    return keys, [torch.randn(PLACED_NS.chunk_shape, generator=gen).half() for _ in keys]


def config(tmp_path, placement: bool = False) -> StoreConfig:
    cfg = StoreConfig(host=HostTierConfig(capacity_bytes=8 * RAW_UNITS * PAGE, page_bytes=PAGE, prefault=False),
                      disk=DiskTierConfig(enabled=False),
                      write_behind=WriteBehindConfig(max_pending_bytes=4 * RAW_UNITS * PAGE, workers=1),
                      eviction_policy="lru")
    if placement:
        verdicts = tmp_path / "verdicts.json"
        verdicts.write_text(json.dumps({"schema": "kvstore.codec-verdicts/2", "model": "test", "model_id": PLACED_NS.model_id,
                                        "dtype": "float16", "codecs": {"int8": {"ppl_change_pct": 0.02, "allowed": True}}}))
        # recomputing a chunk costs 8 ms, loading it from disk 16 us: a disk victim is worth keeping as int8
        cfg.placement = PlacementConfig(codecs=["int8"], verdicts=[str(verdicts)], quality_weight_s=0.0005,
                                        prefill_tokens_per_s=2000.0, disk_read_bytes_per_s=10**9,
                                        encode_on_write=False)
    return cfg


def disk_tier(tmp_path, chunks_room: int) -> FaultyTier:
    return FaultyTier(DiskTier(tmp_path / "disk", chunks_room * RAW_UNITS * PAGE, name="disk"))
