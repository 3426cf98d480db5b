"""How long this member knows that no other member can have taken it for dead: a lease
renewed by its own joins and heartbeats, which it checks right before deleting anything
on a shared tier's medium (self-fencing; docs/cluster.md, "No fencing").

A member is dead once the ledger's clock is ``member_ttl_s`` past its last beat's score
(``cluster/lua/beat.lua``), and that score is the ledger's time when the script ran, after the member sent
it. So nobody reaps the member before ``member_ttl_s`` of the ledger's time has passed since
the send. The member counts from the send on its own monotonic clock, and stops a tenth of
``member_ttl_s`` short: that tenth is what the ledger's clock may gain on the member's over
one ``member_ttl_s`` (rates, a step of the ledger node's wall clock, the clock of the
replica a failover promotes). A medium cannot check a token, so this only narrows the
window to the time between the check and the medium's delete.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Callable, TypeVar

from tiers.base import TierUnavailable

MARGIN = 0.1  # of member_ttl_s: how much the ledger's clock may gain on a member's over it

T = TypeVar("T")


class Lease:
    def __init__(self, member_ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock  # the member's monotonic clock (tests drive their own)
        self._length_s = member_ttl_s * (1 - MARGIN)
        self._until = -math.inf
        # A break in the lease starts a new term: a member that may have been reaped meanwhile
        # must not go on with a delete the ledger granted it before, even once it beats again.
        self.term = 0
        self._lock = threading.Lock()

    def renew(self, beat: Callable[[], T]) -> T:
        """Run ``beat`` (a join or a heartbeat) and, if it succeeded, hold the lease from the
        moment it was sent. A reply that came once the lease had run out starts a new term:
        the member may have been taken for dead, and its work handed over, before it ran."""
        sent = self.clock()
        answer = beat()
        with self._lock:
            if self.clock() >= self._until:
                self.term += 1
            self._until = sent + self._length_s
        return answer

    def check(self, term: int, what: str) -> None:
        """TierUnavailable unless the lease has held without a break since ``term`` was read
        (before the ledger granted the delete) and holds now: otherwise another member may
        have reaped this one, finished its delete and put the key again since."""
        with self._lock:
            if term == self.term and self.clock() < self._until:
                return
        raise TierUnavailable(f"{what}: this member's lease ran out (it may have been taken for dead); "
                              f"the delete is left to the heartbeat")
