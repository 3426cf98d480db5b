"""Puts gathered chunks into the store on a thread of its own, so a slow store never delays
a step and saves never compete with loads for the loader threads.

The engine gathers a step's new chunks into buffers from a bounded pool; when the pool is
empty the saver is behind (the store is pushing back, or slow) and the engine drops the save
and counts it: a dropped save is a future miss, never a wrong load. A put the store refuses
for want of room (``kvstore.api.pushed_back``) is dropped and counted the same way; only a
store that fails otherwise turns the connector off for its back-off. Before putting, the
saver asks the store which of a request's chunks it already holds and skips those.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from connector.availability import Availability
from connector.metadata import ChunkSave
from connector.staging import StagingPool
from connector.stats import StatsRecorder
from kvstore.api import ChunkStore, pushed_back


class Saver:
    skips_present = True  # a chunk the store holds already is not put again

    def __init__(self, store: ChunkStore, pool: StagingPool, availability: Availability, stats: StatsRecorder) -> None:
        self.store, self.pool, self.availability, self.stats = store, pool, availability, stats
        self._queue: queue.Queue = queue.Queue()
        self._claimed: set[bytes] = set()  # chunks gathered or being put: never saved twice at once
        self._pending = 0
        self.error: BaseException | None = None  # a bug found on the saver thread, raised on the engine's
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="connector-saver", daemon=True)
        self._thread.start()

    def claim(self, save: ChunkSave) -> bool:
        """Whether ``save`` should be gathered (False: another request's save of it is in flight)."""
        with self._idle:
            if save.key.id in self._claimed:
                return False
            self._claimed.add(save.key.id)
            return True

    def unclaim(self, save: ChunkSave) -> None:
        with self._idle:
            self._claimed.discard(save.key.id)

    def submit(self, items: list[tuple[ChunkSave, torch.Tensor]]) -> None:
        """One request's consecutive chunks, each gathered into a buffer taken from the pool."""
        with self._idle:
            self._pending += 1
        self._queue.put(items)

    def _loop(self) -> None:
        while (items := self._queue.get()) is not None:
            try:
                self._put(items)
            finally:
                for save, buf in items:
                    self.pool.give(buf)
                with self._idle:
                    self._claimed.difference_update(save.key.id for save, _ in items)
                    self._pending -= 1
                    self._idle.notify_all()

    def _put(self, items: list[tuple[ChunkSave, torch.Tensor]]) -> None:
        if not self.availability.available():
            self.stats.add(dropped_saves=len(items))
            self._lost([save for save, _ in items])
            return
        try:
            for save, buf in items:
                save.key.namespace.check(buf)
        except (ValueError, TypeError) as exc:  # a chunk that does not fit its own namespace: a bug
            self.error = exc
            return
        started = time.perf_counter()
        present = done = refused = 0
        try:
            present = self.store.lookup([save.key for save, _ in items]) if self.skips_present else 0
            for save, buf in items[present:]:
                try:
                    self._put_one(save, buf)
                except ValueError:  # the store refuses this chunk's values (NaN or inf under a lossy
                    refused += 1  # codec): this save fails, the others and the engine go on
                    self._lost([save])
                    continue
                done += 1
        except (ValueError, TypeError) as exc:  # keys of another namespace in one call: a bug
            self.error = exc
            return
        except Exception as exc:
            if pushed_back(exc):  # full now, not gone: these saves are dropped, loads go on
                self.stats.add(dropped_saves=len(items) - present - done - refused)
            else:
                self.availability.failed("put", exc)
                self.stats.add(failed_saves=len(items) - present - done - refused)
            self._lost([save for save, _ in items[present + done + refused:]])
            return
        finally:
            self.stats.add(put_s=time.perf_counter() - started, failed_saves=refused)
        self.stats.add(saved_chunks=done, saved_bytes=done * self.pool.nbytes, skipped_saves=present)

    def _put_one(self, save: ChunkSave, buf: torch.Tensor) -> None:
        self.store.put(save.key, buf, parent=save.parent)

    def _lost(self, saves: list[ChunkSave]) -> None:
        """``saves`` were not put (a producer's saver remembers, so it never promises them)."""

    def flush(self, timeout_s: float) -> bool:
        """Wait until every submitted save is put (or failed); False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
