"""Fault injection for store tests: a tier wrapper whose operations can be held at a gate
(a hung mount, a slow disk), made to fail (an I/O error), or made to return flipped bytes,
and helpers that wait on conditions instead of sleeping.

A ``Gate`` is how a test lines up a race deterministically: the operation stops at the
gate (``entered`` is set), the test does what must happen meanwhile, then ``open()``s it.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

from tiers.base import Buffer, Tier, TierError, TierUnavailable, as_buffers
from tiers.wrapped import WrappedTier


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` until it holds; AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.002)


class ManualClock:
    """``time`` for a module whose monotonic clock moves only when the test moves it
    (``monkeypatch.setattr(module, "time", clock)``): how long a tier has gone without
    progress is then the test's to say, whatever the machine's load."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def __getattr__(self, name):
        return getattr(time, name)


def unlisting_fails_once(index) -> list[tuple[str, list[bytes]]]:
    """Make a shared index's next ``remove`` fail as an unreachable Redis would; returns the
    list the failed call's (tier name, key ids) land in."""
    remove, failed = index.remove, []

    def remove_once(tier_name, key_ids):
        if not failed:
            failed.append((tier_name, list(key_ids)))
            raise TierError("shared index: remove: Redis unreachable (injected)")
        return remove(tier_name, key_ids)

    index.remove = remove_once
    return failed


class Call(threading.Thread):
    """Runs ``fn`` in a thread, keeping its result or exception."""

    def __init__(self, fn, start: bool = True) -> None:
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None
        self.finished = threading.Event()
        if start:
            self.start()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            self.error = exc
        finally:
            self.finished.set()

    def outcome(self, timeout_s: float = 30.0):
        self.join(timeout_s)
        assert not self.is_alive(), "the call did not finish"
        if self.error is not None:
            raise self.error
        return self.result


class Gate:
    """Holds the operations that reach it (of one key, if ``key`` is given) until opened."""

    def __init__(self, key: bytes | None = None, times: int | None = None) -> None:
        self.key = key
        self.times = times  # hold only this many calls, then let the rest through
        self.entered = threading.Event()
        self.waiting = 0
        self._open = threading.Event()

    def applies(self, key: bytes) -> bool:
        return (self.key is None or key == self.key) and (self.times is None or self.times > 0)

    def pass_through(self, key: bytes) -> None:
        if not self.applies(key):
            return
        if self.times is not None:
            self.times -= 1
        self.waiting += 1
        self.entered.set()
        self._open.wait()
        self.waiting -= 1

    def open(self) -> None:
        self._open.set()


class FaultyTier(WrappedTier):
    """Wraps a tier; ``gates[op]`` (a Gate or a list of them) holds, ``failures[op]`` fails the next N calls of an
    operation (write, read, delete, size_of, sync), ``flip_reads`` flips one byte in the
    next N reads' output."""

    def __init__(self, inner: Tier, name: str | None = None) -> None:
        super().__init__(inner, name)
        self.gates: dict[str, Gate | list[Gate]] = {}
        self.failures: dict[str, int] = {}
        self.flip_reads = 0
        self.calls: dict[str, int] = {}
        # what a power loss could take: keys whose last write was not synced since (the
        # medium's truth, not what the store believes); and every key the tier deleted
        self.unsynced: set[bytes] = set()
        self.deleted: set[bytes] = set()

    def _enter(self, op: str, key: bytes) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        gates = self.gates.get(op)
        for gate in gates if isinstance(gates, list) else [gates] if gates else []:
            gate.pass_through(key)
        if self.failures.get(op, 0) > 0:
            self.failures[op] -= 1
            raise TierUnavailable(f"{self.name}: injected {op} failure")

    def write(self, key: bytes, parts: Sequence[Buffer]) -> None:
        self._enter("write", key)
        self.inner.write(key, parts)
        if getattr(self.inner, "is_synced", lambda key: False)(key):  # written over a synced value:
            self.unsynced.discard(key)  # the tier fsynced the new data before the rename
        else:
            self.unsynced.add(key)

    def read_into(self, key: bytes, out) -> int | None:
        self._enter("read", key)
        got = self.inner.read_into(key, out)
        if got and self.flip_reads > 0:
            self.flip_reads -= 1
            last = memoryview(as_buffers(out)[-1]).cast("B")
            last[len(last) // 2] ^= 0x10
        gates = self.gates.get("read_done")  # holds a read whose bytes are in, before they are checked
        for gate in gates if isinstance(gates, list) else [gates] if gates else []:
            gate.pass_through(key)
        return got

    def read_into_hashing(self, key: bytes, out, head_bytes: int, digest) -> int | None:
        """The inner tier's own read-and-hash (its fused path), unless a flipped read is due:
        then the flip happens in ``read_into``, before the bytes are hashed, as a medium
        returning wrong bytes would."""
        if self.flip_reads > 0:
            return super().read_into_hashing(key, out, head_bytes, digest)
        self._enter("read", key)
        return self.inner.read_into_hashing(key, out, head_bytes, digest)

    def delete(self, key: bytes) -> bool:
        self._enter("delete", key)
        gone = self.inner.delete(key)
        self.unsynced.discard(key)
        self.deleted.add(key)
        return gone

    def size_of(self, key: bytes) -> int | None:
        self._enter("size_of", key)
        return self.inner.size_of(key)

    def sync(self, key: bytes) -> None:
        self._enter("sync", key)
        self.inner.sync(key)
        self.unsynced.discard(key)

    def sync_all(self) -> None:
        self._enter("sync_all", b"")
        self.inner.sync_all()
        self.unsynced.clear()

    def close(self) -> None:
        for gates in self.gates.values():
            for gate in gates if isinstance(gates, list) else [gates]:
                gate.open()
        self.inner.close()


def key_lock_waiters(store, tier_name: str, key_id: bytes) -> int:
    """How many threads hold or wait for one (tier, key) mutation lock of a Store."""
    locks = getattr(store, "_locks", None)  # absent in code older than the key locks
    held = None if locks is None else locks._locks.get((tier_name, key_id))
    return 0 if held is None else held[1]
