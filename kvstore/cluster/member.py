"""This daemon as a member of a cluster of daemons sharing the pfs and redis tiers
(docs/cluster.md): it wraps the shared tiers so that they keep the cluster's budget
(kvstore/cluster/budgeted_tier.py), joins the ledger (kvstore/cluster/ledger.py), beats, publishes its
pins, and finishes the unfinished writes and deletes of members that died.

A PFS directory a cluster uses carries a marker file naming the cluster's shared index
prefix. A daemon that is not a member of that cluster refuses to start on it: it would
count only its own view against its own budget and delete the members' chunks, pinned or
not (review #14).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Sequence

from kvstore.cluster.budgeted_tier import BudgetedTier
from kvstore.config import ConfigError, StoreConfig
from kvstore.cluster.lease import Lease
from kvstore.cluster.ledger import BudgetMismatch, Ledger
from tiers.base import TierError

log = logging.getLogger(__name__)

MARKER = ".kvstore-cluster"


def check_pfs_marker(config: StoreConfig, root: Path) -> None:
    """Mark a cluster's PFS directory, or refuse one marked by another cluster (or by a
    cluster this daemon is not a member of)."""
    marker = root / MARKER
    prefix = config.shared_index.key_prefix
    try:
        owner = marker.read_text().strip()
    except FileNotFoundError:
        owner = None
    if not config.cluster.enabled:
        if owner is not None:
            raise ConfigError(f"pfs.path {root} is shared by the cluster with shared index prefix {owner!r}; "
                              f"join it ([store.cluster] enabled, same shared index) or use another directory")
        return
    if owner is None:
        tmp = root / f"{MARKER}.{socket.gethostname()}.{os.getpid()}"
        tmp.write_text(prefix + "\n")
        os.replace(tmp, marker)
    elif owner != prefix:
        raise ConfigError(f"pfs.path {root} belongs to the cluster with shared index prefix {owner!r}, "
                          f"not {prefix!r}; two clusters on one directory would evict each other's chunks")


def default_member_name(config: StoreConfig) -> str:
    """Host and disk path: one daemon per disk directory on a host (its lock), and the same
    name after a restart, so a restarted daemon owns its chunks again."""
    host = socket.gethostname()
    return f"{host}:{config.disk.path}" if config.disk.enabled else f"{host}:{os.getpid()}"


class ClusterMember:
    def __init__(self, config: StoreConfig, forget: Callable[[str, Sequence[bytes]], None]) -> None:
        """``forget(tier name, key ids)`` drops values from the lookup index (the shared index)."""
        self.config = c = config.cluster
        si = config.shared_index
        self.name = c.member or default_member_name(config)
        self._forget = forget
        self.ledger = Ledger(si.url, si.key_prefix, si.cluster, si.socket_timeout_s)
        self.lease = Lease(c.member_ttl_s)  # renewed by join and every heartbeat; fences deletes
        self.info = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                     "disk": config.disk.path if config.disk.enabled else None}
        self.tiers: dict[str, BudgetedTier] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0

    def wrap(self, tier, budget_bytes: int) -> BudgetedTier:
        """The shared tier ``tier``, keeping the cluster's budget for it."""
        budgeted = BudgetedTier(tier, self.ledger, self.name, budget_bytes, self.config.member_ttl_s,
                                self.config.busy_wait_s, self._forget, self.lease)
        self.tiers[tier.name] = budgeted
        return budgeted

    def advertise(self, address: str) -> None:
        """The address this member serves on, in its next heartbeat."""
        self.info = {**self.info, "addr": address}  # a new dict: the heartbeat thread reads the old one whole

    def join(self) -> None:
        """Join the ledger (BudgetMismatch, a ConfigError, if a budget differs), finish what
        this member's previous run left half-written, and start beating."""
        budgets = {name: t.capacity_bytes for name, t in self.tiers.items()}
        try:
            leftovers = self.lease.renew(lambda: self.ledger.join(self.name, budgets, self.info))
        except BudgetMismatch as exc:
            raise ConfigError(str(exc)) from None
        self._remove(leftovers)
        log.info("cluster: joined as %s (%s)", self.name,
                 ", ".join(f"{n} budget {b} bytes" for n, b in budgets.items()))
        self._thread = threading.Thread(target=self._beat, name="cluster-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        """A beat that failed may have run and handed this member a dead member's work: the
        next one passes its token and is answered that work again (``Ledger.beat``)."""
        c = self.config
        token = None
        while not self._stop.wait(c.heartbeat_s):
            try:
                token = token or secrets.token_hex(12)
                handed = self.lease.renew(lambda: self.ledger.beat(self.name, self.info, c.member_ttl_s,
                                                                   c.forget_after_s, token, list(self.tiers)))
                token = None
                self._remove(handed)
                for tier in self.tiers.values():
                    tier.settle()
            except TierError as exc:
                self.errors += 1
                log.warning("cluster: heartbeat failed: %s", exc)

    def _remove(self, pairs: list[tuple[str, bytes]]) -> None:
        """Every tier's share is removed even where another tier's failed: the keys are
        evicting in this member's sets already, and a failure ending the loop left the rest
        of them so for good (a failed removal is remembered by its tier, for ``settle``). Called
        right after the join or beat that handed them over, in the one thread that renews the
        lease: its term now is the one under which they were handed."""
        term = self.lease.term
        by_tier = defaultdict(list)
        for tier, key_id in pairs:
            by_tier[tier].append(key_id)
        failure = None
        for tier, key_ids in by_tier.items():
            if tier in self.tiers:
                try:
                    self.tiers[tier].remove(key_ids, term)
                except TierError as exc:
                    failure = failure or exc
            else:  # a tier this member does not mount: it cannot delete those values
                log.warning("cluster: %d unfinished %s values of a dead member left to a member with that tier",
                            len(key_ids), tier)
        if failure is not None:
            raise failure

    def pin(self, key_ids: Sequence[bytes], ttl_s: float) -> None:
        """Pins other members see: best effort (a Redis outage leaves them local only)."""
        self._best_effort("pin", lambda: self.ledger.pin(self.name, key_ids, ttl_s))

    def unpin(self, key_ids: Sequence[bytes]) -> None:
        self._best_effort("unpin", lambda: self.ledger.unpin(self.name, key_ids))

    def _best_effort(self, what: str, fn) -> None:
        try:
            fn()
        except TierError as exc:
            self.errors += 1
            log.warning("cluster: %s failed: %s", what, exc)

    def close(self) -> None:
        """Leave: pins end and other members no longer count this one as live."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._best_effort("leave", lambda: self.ledger.leave(self.name, self.info))
        self.ledger.close()
