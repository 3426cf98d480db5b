"""A reference model of what a Store may return, and a driver that runs random operations
with injected faults against a real Store and checks every answer against the model.

Promises checked after every step:
- A read returns the bytes (decoded) of the last acknowledged put of its key, or a miss;
  right after a put, a read of that key hits. A put that raised may or may not have taken
  effect. After a restart a read may also return an earlier put since the last durable one
  (a copy written behind that did not reach disk, FS-like), never one from before it.
- Every acknowledged durable put survives a restart, unless a fault destroyed its copy
  (a flipped read drops the replica) or it was deleted; a deleted chunk never comes back.
- A durable chunk's file is synced: a power loss truncates only unsynced files.
- Nothing writes into a caller's buffer after the read call returned.
- ``check_integrity()`` holds (with copies in flight: see kvstore/integrity.py).

Faults: a write that fails, a read that returns flipped bytes, the disk tier hanging for
a while, files truncated to zero by a power loss, and restarts between any two steps.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path

import torch

from faults import FaultyTier, Gate
from helpers import PAGE, chunks, same, store_config
from kvstore.codecs import get_codec
from kvstore.keys import Namespace
from kvstore.store import Store
from tiers.base import TierError
from tiers.disk import DiskTier

CODECS = ("raw", "lz4", "int8", "int4", "mixed75")
NS = Namespace("model-ns", num_layers=2, num_kv_heads=2, head_dim=16, chunk_tokens=8)  # every codec encodes it
MISS = None
SENTINEL = 3.0


class StoreModel:
    """One Store on a temporary directory, the model of it, and one method per operation.
    Methods raise AssertionError when the Store breaks a promise."""

    def __init__(self, keys: int = 10, seed: int = 0) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="store-model-"))
        self.keys, values = chunks(keys, NS, seed=seed)
        self.expected = {(i, c): self._roundtrip(values[i], c) for i in range(keys) for c in CODECS}
        self.values = values
        n = len(self.keys)
        self.ok: list[set] = [{MISS} for _ in range(n)]  # what a read may return now
        self.survives: list[set] = [set() for _ in range(n)]  # puts since (and with) the last durable one
        self.must_survive = [False] * n
        self.synced_here = [False] * n  # durable put acknowledged since the last restart
        self.outs = [torch.full_like(v, SENTINEL) for v in values]
        self.hung: Gate | None = None
        self.steps = 0
        self._open()

    @staticmethod
    def _roundtrip(value: torch.Tensor, codec: str) -> torch.Tensor:
        c = get_codec(codec)
        return c.decode(c.encode(value), value.shape, value.dtype)

    def _open(self) -> None:
        # no takeovers (fetch_stall_s): so no read of a returned call runs on in the background
        # and a read right after a put must hit; tests/test_fetch.py and test_store_races.py
        # cover takeovers
        cfg = store_config(self.root, host=12 * PAGE, disk=None, pending=4 * PAGE, max_pin_ttl_s=0.5,
                           fetch_stall_s=10.0)
        cfg.write_behind.stall_s = 0.2
        cfg.write_behind.durable_timeout_s = 0.3
        self.disk = FaultyTier(DiskTier(self.root / "disk", 1 << 20, name="disk"))
        self.store = Store(cfg, extra_tiers=[self.disk])

    def close(self) -> None:
        self.end_hang()
        self.store.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- checks ------------------------------------------------------------------------------

    def _matches(self, i: int, got: torch.Tensor | None, allowed: set) -> bool:
        if got is None:
            return MISS in allowed
        return any(c is not MISS and same(got, self.expected[(i, c)]) for c in allowed)

    def _check(self, i: int, got: torch.Tensor | None, what: str) -> None:
        assert self._matches(i, got, self.ok[i]), (
            f"step {self.steps}: {what} of key {i} returned {'a miss' if got is None else 'bytes'} "
            f"outside what the model allows ({sorted(map(str, self.ok[i]))})")

    def _buffers_untouched(self) -> None:
        for i, out in enumerate(self.outs):
            assert bool((out == SENTINEL).all()), f"step {self.steps}: buffer {i} was written after its read returned"

    def after_step(self) -> None:
        self.steps += 1
        self._buffers_untouched()
        self.store.check_integrity()

    # -- operations -----------------------------------------------------------------------------

    def put(self, i: int, codec: str, durable: bool) -> None:
        try:
            self.store.put(self.keys[i], self.values[i], codec=codec, durable=durable)
        except (TierError, TimeoutError):
            self.ok[i].add(codec)
            self.survives[i].add(codec)
            return
        self.ok[i] = {MISS, codec}
        if durable:
            self.survives[i], self.must_survive[i], self.synced_here[i] = {codec}, True, True
        else:
            self.survives[i].add(codec)
        out = torch.empty_like(self.values[i])
        hit = self.store.get_into(self.keys[i], out)
        assert hit, f"step {self.steps}: a read right after a put of key {i} missed"
        self._check(i, out, "the read right after a put")

    def get(self, i: int, flip: bool = False) -> None:
        if flip:
            self.disk.flip_reads = 1
        out = torch.empty_like(self.values[i])
        got = out if self.store.get_into(self.keys[i], out) else None
        if flip and self.disk.flip_reads == 0:  # the flip hit the disk replica: it was dropped
            self.must_survive[i] = self.synced_here[i] = False
        self.disk.flip_reads = 0
        self._check(i, got, "get_into")

    def get_many(self, start: int, count: int) -> None:
        keys = self.keys[start : start + count]
        outs = self.outs[: len(keys)]
        n = self.store.get_many_into(keys, outs)
        for j in range(n):
            self._check(start + j, outs[j], "get_many_into")
        for out in outs:
            out.fill_(SENTINEL)

    def stream(self, start: int, count: int, take: int) -> None:
        keys = self.keys[start : start + count]
        outs = self.outs[: len(keys)]
        got = []
        for chunk in self.store.stream(keys, outs=outs):
            got.append(chunk.clone())
            if len(got) == take:
                break
        for j, chunk in enumerate(got):
            self._check(start + j, chunk, "stream")
        for out in outs:
            out.fill_(SENTINEL)

    def delete(self, i: int) -> None:
        self.end_hang()
        self.store.delete([self.keys[i]])
        assert self.store.lookup([self.keys[i]]) == 0, f"step {self.steps}: key {i} present after delete"
        self.ok[i], self.survives[i], self.must_survive[i], self.synced_here[i] = {MISS}, set(), False, False

    def drop_host(self, i: int) -> None:
        self.end_hang()
        self.store.drop([self.keys[i]], "host")

    def pin(self, i: int, ttl_s: float) -> None:
        self.store.pin([self.keys[i]], ttl_s)

    def unpin(self, i: int) -> None:
        self.store.unpin([self.keys[i]])

    def fail_next_write(self) -> None:
        self.disk.failures["write"] = self.disk.failures.get("write", 0) + 1

    def start_hang(self) -> None:
        if self.hung is None:
            self.hung = self.disk.gates["write"] = Gate()

    def end_hang(self) -> None:
        if self.hung is not None:
            self.hung.open()
            del self.disk.gates["write"]
            self.hung = None

    def flush(self) -> None:
        self.end_hang()
        assert self.store.flush(timeout_s=30), f"step {self.steps}: copies not done after 30 s"

    def restart(self, power_loss: bool = False, rng: random.Random | None = None) -> None:
        """Close and reopen the Store; with ``power_loss``, unsynced files may come back empty.
        (Files found at start are not known to be synced: only those of durable puts since the
        last restart must be, and a power loss spares those of earlier durable puts.)"""
        self.end_hang()
        self.store.flush()
        with self.store.index.lock:
            unsynced = [i for i, k in enumerate(self.keys)
                        if (e := self.store.index.get(k.id)) is not None and "disk" in e.replicas
                        and not e.replicas["disk"].synced]
        paths = {i: self.disk.path_of(self.keys[i].id) for i in unsynced}
        self.store.close()
        for i in unsynced:
            assert not self.synced_here[i], f"step {self.steps}: key {i}'s durable put left an unsynced file"
            if power_loss and not self.must_survive[i] and (rng or random).random() < 0.5 and paths[i].exists():
                paths[i].write_bytes(b"")
        self.synced_here = [False] * len(self.keys)
        self._open()
        for i, key in enumerate(self.keys):
            out = torch.empty_like(self.values[i])
            got = out if self.store.get_into(key, out) else None
            allowed = set(self.survives[i]) | ({MISS} if not self.must_survive[i] else set())
            assert self._matches(i, got, allowed or {MISS}), (
                f"step {self.steps}: after a restart key {i} returned {'a miss' if got is None else 'bytes'}; "
                f"allowed: {sorted(map(str, allowed))}")
            found = next((c for c in CODECS if got is not None and same(got, self.expected[(i, c)])), None)
            self.ok[i] = {MISS} | ({found} if found else set())
            self.survives[i] = {found} if found else set()
            self.must_survive[i] = self.must_survive[i] and found is not None


def random_walk(model: StoreModel, steps: int, rng: random.Random) -> None:
    """``steps`` random operations, the mix the hypothesis machine draws from."""
    n = len(model.keys)
    for _ in range(steps):
        r = rng.random()
        i = rng.randrange(n)
        if r < 0.30:
            model.put(i, rng.choice(CODECS), rng.random() < 0.3)
        elif r < 0.45:
            model.get(i, flip=rng.random() < 0.1)
        elif r < 0.55:
            start = rng.randrange(n)
            model.get_many(start, rng.randint(1, n - start))
        elif r < 0.62:
            start = rng.randrange(n)
            count = rng.randint(1, n - start)
            model.stream(start, count, rng.randint(1, count))
        elif r < 0.67:
            model.delete(i)
        elif r < 0.72:
            model.drop_host(i)
        elif r < 0.78:
            model.pin(i, rng.choice((0.01, 0.1, 10.0)))
        elif r < 0.81:
            model.unpin(i)
        elif r < 0.85:
            model.fail_next_write()
        elif r < 0.88:
            model.start_hang()
        elif r < 0.92:
            model.end_hang()
        elif r < 0.95:
            model.flush()
        else:
            model.restart(power_loss=rng.random() < 0.5, rng=rng)
        model.after_step()
