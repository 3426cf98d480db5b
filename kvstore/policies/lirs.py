"""LIRS (Jiang & Zhang, SIGMETRICS'02): rank keys by inter-reference recency, not recency.

Keys whose last two accesses were close together (low IRR) are LIR and own almost all
of the space; everything else is HIR and shares a small resident queue (1%). The stack
S orders keys by recency and also remembers non-resident HIR keys, so a key that comes
back soon enough is promoted to LIR even though it was evicted. Non-resident history is
bounded: the stack holds at most ``1 + history`` entries per resident key (2 by default,
the setting of the reference figures in the traces' README; more history helps
small caches).

A key the owner holds out of the policy (``on_remove``) leaves the stack but is
remembered with its status: handed back, a LIR key is LIR again and a HIR key HIR again
(on top of the stack if it was in it), both as most recent. A hit while it is out counts
as one on a resident key would: a HIR key in the stack becomes LIR, one outside it
enters the stack.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

from kvstore.policies.base import EvictionPolicy
from kvstore.policies.removed import RemovedKeys

HIR_FRACTION = 0.01
HISTORY = 2.0  # non-resident keys remembered per resident key
LIR, HIR_IN_STACK, HIR = "lir", "hir in stack", "hir"  # the status a removed key is handed back with
_AFTER_HIT = {LIR: LIR, HIR_IN_STACK: LIR, HIR: HIR_IN_STACK}


class LIRSPolicy(EvictionPolicy):
    name = "lirs"

    def __init__(self, capacity_bytes: int, history: float = HISTORY) -> None:
        super().__init__(capacity_bytes)
        self._history = history
        self._lir_limit = capacity_bytes - max(1, int(capacity_bytes * HIR_FRACTION))
        self._stack: OrderedDict[Hashable, None] = OrderedDict()  # oldest first
        self._lir: dict[Hashable, int] = {}  # resident LIR key -> size
        self._hir: OrderedDict[Hashable, int] = OrderedDict()  # resident HIR queue, oldest first
        self._ghosts: OrderedDict[Hashable, None] = OrderedDict()  # non-resident HIR in the stack
        self._lir_bytes = 0
        self._removed: RemovedKeys[str] = RemovedKeys()  # removed key -> LIR, HIR_IN_STACK or HIR

    def _prune(self) -> None:
        """Pop HIR keys off the bottom of the stack so that it ends in a LIR key."""
        stack = self._stack
        while stack:
            key = next(iter(stack))
            if key in self._lir:
                return
            stack.popitem(last=False)
            self._ghosts.pop(key, None)

    def _demote_bottom_lir(self) -> None:
        while self._lir_bytes > self._lir_limit:
            self._prune()
            key, _ = self._stack.popitem(last=False)
            size = self._lir.pop(key)
            self._lir_bytes -= size
            self._hir[key] = size
            self._prune()

    def _make_lir(self, key: Hashable, size: int) -> None:
        self._lir[key] = size
        self._lir_bytes += size
        self._stack[key] = None
        self._stack.move_to_end(key)
        self._demote_bottom_lir()

    def on_hit(self, key: Hashable) -> None:
        if key in self._lir:
            at_bottom = next(iter(self._stack)) == key
            self._stack.move_to_end(key)
            if at_bottom:
                self._prune()
        elif key in self._hir:
            size = self._hir[key]
            if key in self._stack:
                del self._hir[key]
                self._make_lir(key, size)
            else:
                self._stack[key] = None
                self._hir.move_to_end(key)
        else:
            self._removed.hit(key, _AFTER_HIT.__getitem__)

    def on_miss(self, key: Hashable) -> None:
        self._removed.pop(key)

    def on_insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        handed_back = self._removed.pop(key)
        if handed_back == LIR:
            self._make_lir(key, size)
            return
        if handed_back is not None:
            self._hir[key] = size
            if handed_back == HIR_IN_STACK:
                self._stack[key] = None
            return
        self._ghosts.pop(key, None)
        if self._lir_bytes + size <= self._lir_limit and not self._hir:
            self._make_lir(key, size)  # warm-up: the cache is not full yet
        elif key in self._stack:
            self._make_lir(key, size)
        else:
            self._stack[key] = None
            self._hir[key] = size

    def evict(self) -> Hashable:
        if self._hir:
            key, _ = self._hir.popitem(last=False)
            if key in self._stack:
                self._ghosts[key] = None
                while self._ghosts and len(self._stack) > (1 + self._history) * max(1, len(self)):
                    self._stack.pop(self._ghosts.popitem(last=False)[0])
            return key
        if not self._lir:
            raise LookupError("no resident key to evict")
        self._prune()  # the bottom may be HIR: pushed while no LIR key was in the stack
        key, _ = self._stack.popitem(last=False)
        self._lir_bytes -= self._lir.pop(key)
        self._prune()
        return key

    def on_remove(self, key: Hashable, held: bool = True) -> None:
        status = None
        if key in self._lir:
            self._lir_bytes -= self._lir.pop(key)
            self._stack.pop(key)
            self._prune()
            status = LIR
        elif key in self._hir:
            del self._hir[key]
            status = HIR_IN_STACK if key in self._stack else HIR
            self._stack.pop(key, None)
        self._removed.removed(key, status, held)

    def victim_rank(self, key: Hashable) -> int | None:
        """Resident HIR keys before LIR keys, as ``evict`` takes them."""
        return 0 if key in self._hir else 1 if key in self._lir else None

    def __len__(self) -> int:
        return len(self._lir) + len(self._hir)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._lir or key in self._hir
