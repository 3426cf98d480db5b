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
- ``check_integrity()`` holds (with copies in flight: see kvstore/store/integrity.py).

Faults: a write that fails, a read that returns flipped bytes, the disk tier hanging for
a while, files truncated to zero by a power loss, and restarts between any two steps.

With ``placement``, the Store re-encodes victims in place and writes its disk copies in the
encoding placement chooses, and plans replicas by utility: a read may then also return
the put's bytes re-encoded by any chain of placement's codecs, each smaller than the last
(a victim kept as int8 may later be kept as int4 of that), never another put's.
"""

from __future__ import annotations

import functools
import json
import random
import shutil
import tempfile
from pathlib import Path

import torch

from faults import FaultyTier, Gate
from helpers import PAGE, chunks, same, store_config
from kvstore.codecs import get_codec
from kvstore.config import PlacementConfig
from kvstore.keys import Namespace
from kvstore.store import Store
from tiers.base import TierError
from tiers.disk import DiskTier

CODECS = ("raw", "lz4", "int8", "int4", "mixed75")
MODEL_NS = Namespace("model-ns", num_layers=2, num_kv_heads=2, head_dim=16, chunk_tokens=8)  # every codec encodes it
# With placement: chunks of 5 pages raw, so re-encoding frees pages (int8 takes 3, int4 2)
NS_PLACED = Namespace("model-ns-placed", num_layers=2, num_kv_heads=2, head_dim=64, chunk_tokens=16)
PLACEMENT_CODECS = ("int8", "mixed50", "mixed25", "int4")  # mixed25 cannot encode NS_PLACED: no candidate
MISS = None
SENTINEL = 3.0


def roundtrip(value: torch.Tensor, codec: str) -> torch.Tensor:
    """What a read of ``value`` put with ``codec`` returns."""
    c = get_codec(codec)
    return c.decode(c.encode(value), value.shape, value.dtype)


def reachable(value: torch.Tensor, codec: str, placement: bool) -> list[torch.Tensor]:
    """What a read of ``value`` put with ``codec`` may return: its roundtrip, and with
    placement every chain of re-encodings of it whose payloads shrink at each step."""
    found, todo = [], [(roundtrip(value, codec), len(get_codec(codec).encode(value)))]
    while todo:
        decoded, size = todo.pop()
        if not any(same(decoded, f) for f in found):
            found.append(decoded)
        if not placement:
            continue
        for name in PLACEMENT_CODECS:
            try:
                smaller = get_codec(name).encode(decoded)
            except ValueError:
                continue
            if len(smaller) < size:
                todo.append((get_codec(name).decode(smaller, value.shape, value.dtype), len(smaller)))
    return found


@functools.lru_cache(maxsize=None)
def expected_reads(keys: int, seed: int, placement: bool) -> dict[tuple[int, str], list[torch.Tensor]]:
    """``reachable`` for every (chunk, codec) of ``chunks(keys, ..., seed)``: the same for
    every model built alike, so computed once (0.2 s with placement; a hypothesis run builds
    a hundred models). Only compared against, never handed to a Store."""
    _, values = chunks(keys, NS_PLACED if placement else MODEL_NS, seed=seed)
    return {(i, c): reachable(values[i], c, placement) for i in range(keys) for c in CODECS}


def place(cfg, root: Path) -> None:
    """Placement that re-encodes: every codec allowed, a disk slow enough that its copies
    are written small and its victims kept smaller, replicas planned by utility."""
    verdicts = root / "verdicts.json"
    verdicts.write_text(json.dumps({
        "schema": "kvstore.codec-verdicts/2", "model": "test", "model_id": NS_PLACED.model_id, "dtype": "float16",
        "codecs": {name: {"ppl_change_pct": 0.1 * (n + 1), "allowed": True} for n, name in enumerate(PLACEMENT_CODECS)}}))
    cfg.placement = PlacementConfig(codecs=list(PLACEMENT_CODECS), verdicts=[str(verdicts)],
                                    prefill_tokens_per_s=2000.0, quality_weight_s=0.0001, host_read_bytes_per_s=10**10,
                                    disk_read_bytes_per_s=10**7, decode_bytes_per_s=10**11)
    cfg.replication.mode = "utility"


class StoreModel:
    """One Store on a temporary directory, the model of it, and one method per operation.
    Methods raise AssertionError when the Store breaks a promise."""

    def __init__(self, keys: int = 10, seed: int = 0, placement: bool = False) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="store-model-"))
        self.placement = placement
        self.keys, values = chunks(keys, NS_PLACED if placement else MODEL_NS, seed=seed)
        # what a read of each put may return: its roundtrip, or with placement any re-encoding chain of it
        self.expected = expected_reads(keys, seed, placement)
        self.values = values
        n = len(self.keys)
        self.ok: list[set] = [{MISS} for _ in range(n)]  # what a read may return now
        self.survives: list[set] = [set() for _ in range(n)]  # puts since (and with) the last durable one
        self.must_survive = [False] * n
        self.synced_here = [False] * n  # durable put acknowledged since the last restart
        self.outs = [torch.full_like(v, SENTINEL) for v in values]
        self.evicted: set[bytes] = set()  # keys the disk policy chose as victims
        self.hung: Gate | None = None
        self.steps = 0
        self._open()

    def _open(self) -> None:
        # no takeovers (fetch_stall_s): so no read of a returned call runs on in the background
        # and a read right after a put must hit; tests/store/test_fetch.py and test_store_races.py
        # cover takeovers
        cfg = store_config(self.root, host=(24 if self.placement else 12) * PAGE, disk=None,
                           pending=(12 if self.placement else 4) * PAGE, max_pin_ttl_s=0.5, fetch_stall_s=10.0)
        cfg.write_behind.stall_s = 0.2
        cfg.write_behind.durable_timeout_s = 0.3
        disk_bytes = 1 << 20
        if self.placement:
            place(cfg, self.root)
            disk_bytes = 6 * 5 * PAGE  # six raw chunks of the ten: disk victims are re-encoded too
        old = getattr(self, "disk", None)
        self.disk = FaultyTier(DiskTier(self.root / "disk", disk_bytes, name="disk"))
        if old is not None:  # the same files: what is unsynced stays so until synced
            self.disk.unsynced, self.disk.deleted = old.unsynced, old.deleted
        self.store = Store(cfg, extra_tiers=[self.disk])
        self._watch_disk_evictions()

    def _watch_disk_evictions(self) -> None:
        """Record the disk policy's victims: a durable chunk the disk evicts for room is lost
        by design, not by a fault."""
        policy = self.store.index.policies["disk"]
        evict = policy.evict

        def watched() -> bytes:
            victim = evict()
            self.evicted.add(victim)
            return victim

        policy.evict = watched

    def close(self) -> None:
        self.end_hang()
        self.store.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- checks ------------------------------------------------------------------------------

    def _matches(self, i: int, got: torch.Tensor | None, allowed: set) -> bool:
        if got is None:
            return MISS in allowed
        return any(c is not MISS and any(same(got, e) for e in self.expected[(i, c)]) for c in allowed)

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
        key_id = self.keys[i].id
        lost = key_id in self.evicted, key_id in self.disk.deleted
        if durable:  # whatever happened to earlier copies, this put's must be kept
            with self.store.index.lock:
                entry = self.store.index.get(key_id)
                recoding = entry is not None and "disk" in entry.recoding
            if not recoding:  # a victim being re-encoded may still leave: its eviction is under way
                self.evicted.discard(key_id)
            self.disk.deleted.discard(key_id)
        try:
            self.store.put(self.keys[i], self.values[i], codec=codec, durable=durable)
        except (TierError, TimeoutError):
            if lost[0]:  # no new promise: the earlier durable put's copy is still gone
                self.evicted.add(key_id)
            if lost[1]:
                self.disk.deleted.add(key_id)
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
        """Close and reopen the Store; with ``power_loss``, files written since their last sync
        (the medium's record, not the store's) may come back empty. A durable chunk may be
        missing only if the disk evicted it for room."""
        self.end_hang()
        self.store.flush()
        self.store.close()
        evicted = [key.id in self.evicted and key.id in self.disk.deleted for key in self.keys]
        for i, key in enumerate(self.keys):
            if key.id not in self.disk.unsynced:
                continue
            assert not self.synced_here[i] or evicted[i], f"step {self.steps}: key {i}'s durable put left an unsynced file"
            path = self.disk.path_of(key.id)
            if power_loss and (rng or random).random() < 0.5 and path.exists():
                path.write_bytes(b"")
        self.synced_here = [False] * len(self.keys)
        self._open()
        for i, key in enumerate(self.keys):
            out = torch.empty_like(self.values[i])
            got = out if self.store.get_into(key, out) else None
            allowed = set(self.survives[i]) | ({MISS} if evicted[i] or not self.must_survive[i] else set())
            assert self._matches(i, got, allowed or {MISS}), (
                f"step {self.steps}: after a restart key {i} returned {'a miss' if got is None else 'bytes'}; "
                f"allowed: {sorted(map(str, allowed))}")
            found = next((c for c in CODECS if got is not None and self._matches(i, got, {c})), None)
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
