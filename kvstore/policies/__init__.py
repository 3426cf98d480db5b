"""Eviction policy registry: configuration picks a policy by name."""

from __future__ import annotations

from kvstore.policies.base import EvictionPolicy
from kvstore.policies.arc import ARCPolicy
from kvstore.policies.lirs import LIRSPolicy
from kvstore.policies.lrfu import LRFUPolicy
from kvstore.policies.lru import LRUPolicy
from kvstore.policies.s3fifo import S3FIFOPolicy
from kvstore.policies.shadow_vote import ShadowVotePolicy
from kvstore.policies.wtinylfu import WTinyLFUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {}
DEFAULT_POLICY = "shadow-vote"


def register(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    if cls.name in POLICIES:
        raise ValueError(f"policy {cls.name!r} is already registered")
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, capacity_bytes: int) -> EvictionPolicy:
    """A new policy instance; ``default`` names the store's default policy."""
    if name == "default":
        name = DEFAULT_POLICY
    try:
        cls = POLICIES[name]
    except KeyError:
        raise KeyError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None
    return cls(capacity_bytes)


for _cls in (LRUPolicy, ARCPolicy, S3FIFOPolicy, LIRSPolicy, LRFUPolicy, WTinyLFUPolicy, ShadowVotePolicy):
    register(_cls)

__all__ = ["EvictionPolicy", "POLICIES", "DEFAULT_POLICY", "register", "make_policy"]
