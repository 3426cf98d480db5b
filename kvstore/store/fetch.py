"""Free-tier fetching: read N ordered chunks from whichever replica's tier is idle.

A fetch is a queue of chunks. Every tier that holds some of them runs its own workers
(as many as its useful queue depth); an idle worker claims the earliest chunk that is not
yet fetched and that its tier holds, so fast and slow tiers all stay busy and the
aggregate bandwidth approaches the sum of theirs. Chunks are delivered in order as soon as
their predecessors are in. A replica that fails (error, corruption, vanished) is crossed
off for that chunk and another tier takes it; a chunk in flight for longer than
``stall_s`` may be taken over by another tier's worker (the first to finish wins). When
no replica of a chunk can deliver, the fetch ends there: later chunks are useless to a
prefix cache.

The caller's buffers (``outs``) belong to the fetch until ``close`` returns: it stops
handing out work and waits for every read still writing into one. Takeovers read into
buffers of their own (the stalled reader may still be writing ``out``), and so do tiers
named ``detached``: tiers that may hang for long (a shared mount, a remote server), whose
stalled reads ``close`` must not wait for.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch


@dataclass
class _Chunk:
    replicas: frozenset[str]
    out: torch.Tensor
    in_flight: dict[str, float] = field(default_factory=dict)  # tier -> claim time
    failed: set[str] = field(default_factory=set)
    result: torch.Tensor | None = None
    writing_out: int = 0  # reads in flight into ``out`` itself
    winner: str | None = None  # the tier whose read ``accept``ed the chunk (its result to come)


log = logging.getLogger(__name__)

ReadFn = Callable[[str, int, torch.Tensor], bool]


class FetchJob:
    """One ordered fetch. ``read(tier, index, out)`` reads chunk ``index`` from ``tier``
    into ``out`` and returns whether it succeeded (it records failures itself)."""

    def __init__(self, replicas: Sequence[frozenset[str]], outs: Sequence[torch.Tensor], read: ReadFn, stall_s: float,
                 detached: frozenset[str] | set[str] = frozenset()) -> None:
        self._chunks = [_Chunk(r, o) for r, o in zip(replicas, outs)]
        self._read = read
        self.stall_s = stall_s
        self._detached = detached
        self._closed = False
        self._cond = threading.Condition()
        self._first_open = 0  # every chunk before this one is done
        self._end = len(self._chunks)  # chunks from here on are abandoned
        self.reads_by_tier: dict[str, int] = {}

    def accept(self, index: int, tier: str) -> bool:
        """Whether ``tier``'s read of chunk ``index``, read and verified, is the one that serves
        it: the first to ask wins; the loser of a takeover (both finished) is not a hit. A read
        function that never asks keeps the old rule (the first to finish wins)."""
        with self._cond:
            chunk = self._chunks[index]
            if chunk.winner is None and chunk.result is None:
                chunk.winner = tier
            return chunk.winner == tier

    def tiers(self) -> set[str]:
        return set().union(*(c.replicas for c in self._chunks)) if self._chunks else set()

    def _claimable(self, tier: str, now: float) -> tuple[int, bool] | None:
        """The earliest chunk ``tier`` may take, and whether taking it is a takeover."""
        if self._closed:
            return None
        for i in range(self._first_open, self._end):
            c = self._chunks[i]
            if c.result is not None or tier not in c.replicas or tier in c.failed or tier in c.in_flight:
                continue
            if not c.in_flight:
                return i, False
            if now - min(c.in_flight.values()) > self.stall_s:
                return i, True
        return None

    def _may_need(self, tier: str) -> bool:
        """Whether ``tier`` could still be asked for work (so its worker should wait, not exit)."""
        if self._closed:
            return False
        for i in range(self._first_open, self._end):
            c = self._chunks[i]
            if c.result is None and tier in c.replicas and tier not in c.failed and tier not in c.in_flight and c.in_flight:
                return True
        return False

    def work(self, tier: str) -> None:
        """One worker of ``tier``: claim, read, repeat until nothing is left for this tier."""
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    claim = self._claimable(tier, now)
                    if claim is not None or not self._may_need(tier):
                        break
                    self._cond.wait(timeout=self.stall_s / 4)
                if claim is None:
                    return
                index, takeover = claim
                chunk = self._chunks[index]
                chunk.in_flight[tier] = now
                own = takeover or tier in self._detached
                chunk.writing_out += not own
            target = torch.empty_like(chunk.out) if own else chunk.out
            ok = False
            try:
                ok = self._read(tier, index, target)
            except Exception:  # noqa: BLE001 - not a tier's failure (those are False): a bug, or a
                # Store closing under a promotion. This tier failed this chunk; the worker goes
                # on, or a chunk only this tier holds would never be claimed and results() wait.
                log.exception("fetch: a read of chunk %d from %s raised", index, tier)
            finally:
                with self._cond:
                    chunk.in_flight.pop(tier, None)
                    chunk.writing_out -= not own
                    if not ok and chunk.winner == tier:
                        chunk.winner = None  # accepted, then failed: another tier may serve it
                    if ok and chunk.result is None and chunk.winner in (None, tier):
                        chunk.result = target
                        self.reads_by_tier[tier] = self.reads_by_tier.get(tier, 0) + 1
                    elif not ok:
                        chunk.failed.add(tier)
                        if chunk.result is None and not chunk.in_flight and chunk.failed >= chunk.replicas:
                            self._end = min(self._end, index)
                    self._cond.notify_all()

    def results(self) -> Iterator[torch.Tensor]:
        """Chunks in order, each as soon as it and all before it are in."""
        i = 0
        while True:
            with self._cond:
                while i < self._end and self._chunks[i].result is None:
                    self._cond.wait()
                if i >= self._end:
                    return
                self._first_open = i + 1
                result = self._chunks[i].result
            yield result
            i += 1

    def close(self) -> None:
        """Stop handing out work, and return once no read writes into the caller's buffers."""
        with self._cond:
            self._closed = True
            self._end = min(self._end, self._first_open)
            self._cond.notify_all()
            while any(c.writing_out for c in self._chunks):
                self._cond.wait()
