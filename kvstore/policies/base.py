"""The EvictionPolicy interface: admission and eviction order for one tier.

A policy only orders keys; its owner (a Store tier or a trace simulator) does the
removing. The owner reports every access and every change of residency:

- ``on_hit(key)`` for an access to a resident key (or to a removed key its owner still
  holds; below), ``on_miss(key)`` for an access to a key that is not resident (ghost
  lists and frequency sketches learn from it);
- ``admit(key, size, parent)`` before inserting a missed key: False means do not cache it;
- ``on_insert(key, size, parent)`` once the key is resident; ``parent`` is the key of the
  previous chunk of the same prefix (None for a first chunk), so a policy can use the
  prefix structure: a chunk is only usable if all chunks before it are resident too;
- ``evict()`` when space is needed: the policy picks a resident key, forgets it as
  resident (keeping any history it wants) and returns it, and the owner deletes it;
- ``on_remove(key, held)`` when a key leaves for another reason: *held* (still stored,
  but not evictable for a while: pinned, being re-encoded, or, in a Store's first tier,
  while its copies to lower tiers are queued), or, with ``held=False``, for good
  (deleted, dropped, corrupt);
- ``reinstate(key, size, parent)`` when the key ``evict`` just returned stays resident after
  all, re-encoded smaller (placement compressed it in place instead of dropping it).

Removed keys and hand-backs. After ``on_remove(key)`` of a held key a policy may remember
it with its standing (ARC's list, LIRS's status, S3-FIFO's queue and frequency, ...), for
at most a fixed number of removed keys, the oldest forgotten first
(``removed.RemovedKeys``). A later ``on_insert`` of a remembered key is a *hand-back*: not
an access; the key is resident again with the standing it had. An ``on_hit`` of a
remembered key is an access while it was held (a pinned chunk being loaded): the policy
counts it in the remembered standing, as it would a hit on a resident key (ARC: a T1 key
comes back in T2). An ``on_miss`` of a remembered key says the owner does not hold it
after all, and ``on_remove(key, held=False)`` that it left for good: the policy forgets
it, so a later ``on_insert`` is a new insertion. A key the policy no longer remembers
simply comes back as a new insertion.

Placement also asks ``reuse_estimate(key)`` for a resident key or the key ``evict`` just
returned: how much further use the policy expects of it, relative to a typical chunk. A
Store keeping an owner within its quota asks ``victim_rank(key)`` of that owner's keys, to
evict among them alone in the policy's order (kvstore/store/owner_quota.py).

Keys are opaque hashables. Sizes are bytes; capacity is the tier's capacity in bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Hashable


class EvictionPolicy(ABC):
    name: ClassVar[str]

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes

    @abstractmethod
    def on_hit(self, key: Hashable) -> None:
        """A resident key was accessed, or a removed key the owner still holds (pinned, say):
        a policy that remembers it counts the hit for its hand-back; unknown keys: no-op or
        an access to a non-resident key, as the policy likes."""

    def on_miss(self, key: Hashable) -> None:
        """A non-resident key was accessed; a remembered removed key is forgotten (its owner
        does not hold it, so no hand-back is coming)."""

    def admit(self, key: Hashable, size: int, parent: Hashable | None = None) -> bool:
        """Whether a missed key should be cached at all."""
        return True

    @abstractmethod
    def on_insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        """``key`` is now resident and occupies ``size`` bytes. A key remembered since its
        ``on_remove`` is handed back: not an access, it keeps the standing it had."""

    @abstractmethod
    def on_remove(self, key: Hashable, held: bool = True) -> None:
        """``key`` left for a reason other than eviction. ``held``: its owner still has it and
        may hand it back with ``on_insert``, so the policy may remember its standing (for a
        bounded number of keys); False: it is gone, forget it. Unknown keys are ignored."""

    @abstractmethod
    def evict(self) -> Hashable:
        """Choose, forget and return a resident key; LookupError when none is resident."""

    def reinstate(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        """The key ``evict`` just returned stays resident, now ``size`` bytes. Not an access:
        a policy that learns from accesses must not count it. Default: a new insertion."""
        self.on_insert(key, size, parent)

    def reuse_estimate(self, key: Hashable) -> float:
        """Expected further use of ``key`` relative to a typical resident chunk (1.0); 0.0
        means none. Default: no statistics, so every chunk is typical."""
        return 1.0

    def victim_rank(self, key: Hashable) -> Any:
        """Where ``key`` stands in this policy's eviction order, as a value that sorts lower
        the sooner the key would be evicted (values of one policy compare with each other);
        None when the key is not resident. Exact where the policy keeps one total order (LRU,
        shadow-vote); otherwise the order the policy's evictions mostly follow. Default:
        least expected reuse first."""
        return self.reuse_estimate(key) if key in self else None

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys the policy tracks."""

    def __contains__(self, key: Hashable) -> bool:
        raise NotImplementedError
