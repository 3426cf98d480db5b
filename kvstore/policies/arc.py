"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03), counted in bytes.

T1 holds keys seen once recently, T2 keys seen at least twice; the ghost lists B1 and
B2 remember keys recently evicted from each. A miss that hits a ghost shows which side
was too small and moves the target size ``p`` of T1 towards it. With unit sizes this is
exactly the paper's algorithm; the owner inserts first and then calls ``evict``, so the
replacement decision ignores the key just inserted, as the paper's REPLACE runs before
the insert.

A key the owner holds out of the policy (``on_remove``) is remembered with its list:
handed back, it returns to the same list (most recent end), and a hit while it was out
moves it to T2, as a hit on a resident T1 key does; neither moves ``p`` nor touches the
ghost lists.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

from kvstore.policies.base import EvictionPolicy
from kvstore.policies.removed import RemovedKeys


class ARCPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.p = 0.0
        self._t1: OrderedDict[Hashable, int] = OrderedDict()
        self._t2: OrderedDict[Hashable, int] = OrderedDict()
        self._b1: OrderedDict[Hashable, int] = OrderedDict()
        self._b2: OrderedDict[Hashable, int] = OrderedDict()
        self._bytes = {"t1": 0, "t2": 0, "b1": 0, "b2": 0}
        self._ghost_hit: str | None = None  # "b1", "b2" or None for the pending miss
        self._incoming: Hashable | None = None  # the key inserted before this round of evictions
        self._evict_t1_unghosted = False  # paper case IV(A) with T1 full: no ghost kept
        self._removed: RemovedKeys[str] = RemovedKeys()  # removed key -> "t1" or "t2"

    def _pop(self, lst: str, key: Hashable | None = None) -> tuple[Hashable, int]:
        d: OrderedDict = getattr(self, "_" + lst)
        if key is None:
            key, size = d.popitem(last=False)
        else:
            size = d.pop(key)
        self._bytes[lst] -= size
        return key, size

    def _push(self, lst: str, key: Hashable, size: int) -> None:
        getattr(self, "_" + lst)[key] = size
        self._bytes[lst] += size

    def on_hit(self, key: Hashable) -> None:
        if key in self._t1:
            self._push("t2", *self._pop("t1", key))
        elif key in self._t2:
            self._t2.move_to_end(key)
        else:
            self._removed.hit(key, lambda lst: "t2")

    def on_miss(self, key: Hashable) -> None:
        self._removed.pop(key)
        b = self._bytes
        if key in self._b1:
            size = self._b1[key]
            self.p = min(self.capacity_bytes, self.p + size * max(1.0, b["b2"] / b["b1"]))
            self._ghost_hit = "b1"
        elif key in self._b2:
            size = self._b2[key]
            self.p = max(0.0, self.p - size * max(1.0, b["b1"] / b["b2"]))
            self._ghost_hit = "b2"
        else:
            self._ghost_hit = None

    def on_insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        handed_back = self._removed.pop(key)
        if handed_back is not None:
            self._push(handed_back, key, size)
            return
        c, b = self.capacity_bytes, self._bytes
        ghost = self._ghost_hit if (key in self._b1 or key in self._b2) else None
        self._ghost_hit = ghost
        if ghost:
            self._pop(ghost, key)
            self._push("t2", key, size)
        else:
            l1 = b["t1"] + b["b1"]
            if l1 + size > c:
                while self._b1 and b["t1"] + b["b1"] + size > c:
                    self._pop("b1")
                self._evict_t1_unghosted = b["t1"] + size > c
            elif l1 + b["t2"] + b["b2"] + size > c:
                while self._b2 and b["t1"] + b["b1"] + b["t2"] + b["b2"] + size > 2 * c:
                    self._pop("b2")
            self._push("t1", key, size)
        self._incoming = key

    def evict(self) -> Hashable:
        if not self._t1 and not self._t2:
            raise LookupError("no resident key to evict")
        unghosted, self._evict_t1_unghosted = self._evict_t1_unghosted, False
        if unghosted and self._t1:  # (T1 may have emptied since: hits, removals)
            return self._pop("t1")[0]
        t1 = self._bytes["t1"]
        incoming = self._incoming
        if incoming in self._t1:
            t1 -= self._t1[incoming]
        take_t1 = t1 > 0 and (t1 > self.p or (self._ghost_hit == "b2" and t1 == self.p))
        t2_others = len(self._t2) - (incoming in self._t2)
        if not self._t1 or (not take_t1 and t2_others > 0):
            key, size = self._pop("t2")
            self._push("b2", key, size)
        else:
            key, size = self._pop("t1")
            self._push("b1", key, size)
        return key

    def reinstate(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        """Back from the ghost list ``evict`` put it on to the list it left, without
        moving ``p`` (a reinstatement is not a ghost hit)."""
        for ghost, resident in (("b1", "t1"), ("b2", "t2")):
            if key in getattr(self, "_" + ghost):
                self._pop(ghost, key)
                self._push(resident, key, size)
                return
        self._push("t1", key, size)

    def on_remove(self, key: Hashable, held: bool = True) -> None:
        lst = "t1" if key in self._t1 else "t2" if key in self._t2 else None
        if lst is not None:
            self._pop(lst, key)
        self._removed.removed(key, lst, held)

    def victim_rank(self, key: Hashable) -> int | None:
        """Keys seen once (T1) before keys seen again (T2); where ``p`` would take T2 first
        is left out."""
        return 0 if key in self._t1 else 1 if key in self._t2 else None

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._t1 or key in self._t2
