"""A second fault campaign: the Store's APIs the first one (tests/store/store_model.py) leaves out,
mixed with the usual ones, on three tiers at once (host RAM, a private disk, a shared PFS
directory), checked against a model after every step.

Driven here and not there: ``borrow``, ``lend`` and ``lend_many`` held open across later steps
(their bytes must not change while held, even as the key is deleted, re-put or evicted),
``get_blob``/``put_blob``, ``prefetch`` (promotions), ``stream(..., tiers=...)``,
``replicas``, ``lookup`` with pins, free-tier fetching over two replica tiers with
takeovers (a small ``fetch_stall_s`` and reads that hang on one tier), and re-puts of one
key with other values as well as other codecs: a read must return the bytes of the last
acknowledged put (value and codec) or a miss, never another put's.

Faults: failed writes on either replica tier, flipped reads, a disk whose writes hang, a
tier whose reads hang (ended by a watchdog so the walk goes on), restarts (with power
losses that empty the disk files written since their last sync).

The bounded walk runs in CI; ``-m long`` runs ``KVSTORE_MODEL_STEPS`` steps (default 20,000).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from faults import Call, FaultyTier, Gate
from helpers import PAGE, same, store_config
from kvstore.blob import encode_header, verify_blob
from kvstore.codecs import codec_by_id, get_codec
from kvstore.keys import Namespace, chunk_keys
from kvstore.store import Store
from tiers.base import Tier, TierError
from tiers.disk import DiskTier
from tiers.pfs import PfsTier

CODECS = ("raw", "lz4", "int8", "int4")
VALUES = 3  # different values a key is put with
WALK_NS = Namespace("walk-ns", num_layers=2, num_kv_heads=2, head_dim=16, chunk_tokens=8)  # 2 KiB raw
MISS = None
SENTINEL = 3.0
REPLICA_TIERS = ("disk", "pfs")


class Faulty(FaultyTier):
    """FaultyTier whose flipped read applies to one key only (a reader thread may read
    other keys meanwhile: the walk must know whose replica a flip dropped)."""

    flip_key: bytes | None = None

    def read_into(self, key: bytes, out):
        if key == self.flip_key:
            return super().read_into(key, out)
        self._enter("read", key)
        got = self.inner.read_into(key, out)
        gates = self.gates.get("read_done")
        for gate in gates if isinstance(gates, list) else [gates] if gates else []:
            gate.pass_through(key)
        return got

    def read_into_hashing(self, key: bytes, out, head_bytes: int, digest):
        if self.flip_reads > 0 and key == self.flip_key:
            return Tier.read_into_hashing(self, key, out, head_bytes, digest)
        self._enter("read", key)
        return self.inner.read_into_hashing(key, out, head_bytes, digest)


def roundtrip(value: torch.Tensor, codec: str) -> torch.Tensor:
    c = get_codec(codec)
    return c.decode(c.encode(value), value.shape, value.dtype)


class Walk:
    def __init__(self, keys: int = 6, seed: int = 0, watchdog_s: float = 0.3) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="store-walk-"))
        gen = torch.Generator().manual_seed(seed)
        self.keys = chunk_keys(torch.randint(0, 50_000, (keys * WALK_NS.chunk_tokens,), generator=gen).tolist(), WALK_NS)
        self.values = [[torch.randn(WALK_NS.chunk_shape, generator=gen).half() for _ in range(VALUES)] for _ in self.keys]
        self.expected = {(i, v, c): roundtrip(self.values[i][v], c)
                         for i in range(keys) for v in range(VALUES) for c in CODECS}
        n = keys
        self.ok: list[set] = [{MISS} for _ in range(n)]  # (value, codec) a read may return now
        self.survives: list[set] = [set() for _ in range(n)]
        self.must_survive = [False] * n
        self.synced_here = [False] * n
        self.outs = [torch.full(WALK_NS.chunk_shape, SENTINEL, dtype=torch.float16) for _ in range(n)]
        self.held: list[tuple] = []  # (release, tensor or views, snapshot bytes, what)
        self.write_hang: Gate | None = None
        self.read_hang: tuple[str, Gate] | None = None
        self.watchdog_s = watchdog_s
        self.steps = 0
        self.log: list[str] = []
        # what ok[i] has been, in order, and puts in progress: a read running alongside the
        # walk's steps may return what any of them allowed while it ran
        self.history: list[list[set]] = [[{MISS}] for _ in range(n)]
        self.hlock = threading.Lock()
        self.reader: Reader | None = None
        self._open()

    def _open(self) -> None:
        cfg = store_config(self.root, host=16 * PAGE, disk=None, pending=8 * PAGE, max_pin_ttl_s=0.5,
                           fetch_stall_s=0.05)
        cfg.write_behind.stall_s = 0.2
        cfg.write_behind.durable_timeout_s = 0.5
        old = getattr(self, "disk", None)
        self.disk = Faulty(DiskTier(self.root / "disk", 1 << 20, name="disk"))
        self.pfs = Faulty(PfsTier(self.root / "pfs", 1 << 20, name="pfs"))
        if old is not None:
            self.disk.unsynced, self.disk.deleted = old.unsynced, old.deleted
        self.tiers = {"disk": self.disk, "pfs": self.pfs}
        self.store = Store(cfg, extra_tiers=[self.disk, self.pfs], extra_fetch_workers={"disk": 2, "pfs": 2})

    def _seen(self, i: int, allowed: set | None = None) -> None:
        with self.hlock:
            self.history[i].append(set(self.ok[i] if allowed is None else allowed))

    def since(self, i: int) -> int:
        with self.hlock:
            return len(self.history[i]) - 1

    def allowed_since(self, i: int, mark: int) -> set:
        with self.hlock:
            return set().union(*self.history[i][mark:])

    def start_reader(self, seed: int) -> None:
        if self.reader is None:
            self.log.append("start_reader")
            self.reader = Reader(self, seed)

    def stop_reader(self) -> None:
        if self.reader is not None:
            self.log.append("stop_reader")
            self.end_read_hang()  # its read may wait on a hung tier that alone holds the chunk
            reader, self.reader = self.reader, None
            reader.stop()

    def close(self) -> None:
        self.end_hangs()
        self.stop_reader()
        self.release_all()
        self.store.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- checks --------------------------------------------------------------------------------

    def _matches(self, i: int, got, allowed: set) -> bool:
        if got is None:
            return MISS in allowed
        return any(a is not MISS and same(got, self.expected[(i, *a)]) for a in allowed)

    def _which(self, i: int, got) -> str:
        if got is None:
            return "a miss"
        hits = [(v, c) for v in range(VALUES) for c in CODECS if same(got, self.expected[(i, v, c)])]
        return f"bytes of {hits}" if hits else "bytes of no put"

    def _check(self, i: int, got, what: str, allowed: set | None = None) -> None:
        allowed = self.ok[i] if allowed is None else allowed
        assert self._matches(i, got, allowed), (
            f"step {self.steps}: {what} of key {i} returned {self._which(i, got)}; allowed {sorted(map(str, allowed))}"
            f"\nlast steps: {self.log[-15:]}")

    def after_step(self) -> None:
        self.steps += 1
        if self.reader is not None and self.reader.error is not None:
            raise AssertionError(f"step {self.steps}: the reader thread: {self.reader.error}\nlast steps: {self.log[-15:]}")
        for i, out in enumerate(self.outs):
            assert bool((out == SENTINEL).all()), f"step {self.steps}: buffer {i} was written after its read returned\n{self.log[-15:]}"
        for _, view, snapshot, what in self.held:
            assert bytes(view) == snapshot, f"step {self.steps}: {what}'s bytes changed while held\n{self.log[-15:]}"
        try:
            self.store.check_integrity()
        except AssertionError as exc:
            # a held borrow or lent chunk keeps the pages of a value deleted or replaced
            # meanwhile: the host tier counts them until they are released (by design)
            problems = str(exc).removeprefix("store integrity: ").split("; ")
            if not (self.held or self.reader) or not all(re.fullmatch(r"host: uses \d+ bytes, its values' footprints add up to \d+", p)
                                        for p in problems):
                raise AssertionError(f"{exc}\nlast steps: {self.log[-15:]}") from None

    def _watched(self, fn):
        """Run ``fn``; a read hang that holds it past the watchdog ends (the tier recovers)."""
        if self.read_hang is None:
            return fn()
        call = Call(fn)
        if not call.finished.wait(self.watchdog_s):
            self.end_read_hang()
        return call.outcome()

    # -- the usual operations ------------------------------------------------------------------

    def put(self, i: int, v: int, codec: str, durable: bool, blob: bool = False) -> None:
        self.log.append(f"put({i}, v{v}, {codec}, durable={durable}, blob={blob})")
        key = self.keys[i]
        if durable:
            self.disk.deleted.discard(key.id)
        self._seen(i, self.ok[i] | {(v, codec)})  # in progress: the old bytes, or the new
        try:
            if blob:
                c = get_codec(codec)
                kv = self.values[i][v]
                payload = c.encode(kv)
                header = encode_header(key, c.codec_id, kv.dtype, kv.shape, payload)
                self.store.put_blob(key.id, [header, payload], durable=durable)
            else:
                self.store.put(key, self.values[i][v], codec=codec, durable=durable)
        except (TierError, TimeoutError):
            self.ok[i].add((v, codec))
            self.survives[i].add((v, codec))
            self._seen(i)
            return
        self.ok[i] = {MISS, (v, codec)}
        self._seen(i)
        if durable:
            self.survives[i], self.must_survive[i], self.synced_here[i] = {(v, codec)}, True, True
        else:
            self.survives[i].add((v, codec))
        out = torch.empty(WALK_NS.chunk_shape, dtype=torch.float16)
        hit = self._watched(lambda: self.store.get_into(key, out))
        assert hit, f"step {self.steps}: a read right after a put of key {i} missed\n{self.log[-15:]}"
        self._check(i, out, "the read right after a put")

    def get(self, i: int, flip: str | None = None) -> None:
        self.log.append(f"get({i}, flip={flip})")
        if flip:
            self.tiers[flip].flip_key, self.tiers[flip].flip_reads = self.keys[i].id, 1
        out = torch.empty(WALK_NS.chunk_shape, dtype=torch.float16)
        got = out if self._watched(lambda: self.store.get_into(self.keys[i], out)) else None
        if flip and self.tiers[flip].flip_reads == 0:
            self.must_survive[i] = self.synced_here[i] = False  # that replica was dropped
        if flip:
            self.tiers[flip].flip_reads, self.tiers[flip].flip_key = 0, None
        self._check(i, got, "get_into")

    def get_blob(self, i: int) -> None:
        self.log.append(f"get_blob({i})")
        blob = self._watched(lambda: self.store.get_blob(self.keys[i]))
        self._check(i, self._decoded(i, blob), "get_blob")

    def _decoded(self, i: int, blob):
        if blob is None:
            return None
        header, payload = verify_blob(blob)
        assert header.key_id == self.keys[i].id
        return codec_by_id(header.codec_id).decode(payload, header.shape, header.dtype)

    def get_many(self, start: int, count: int) -> None:
        self.log.append(f"get_many({start}, {count})")
        keys = self.keys[start:start + count]
        outs = self.outs[: len(keys)]
        allowed = [set(self.ok[start + j]) for j in range(len(keys))]
        n = self._watched(lambda: self.store.get_many_into(keys, outs))
        for j in range(n):
            self._check(start + j, outs[j], "get_many_into", allowed[j])
        for out in outs:
            out.fill_(SENTINEL)

    def stream(self, start: int, count: int, take: int, tiers) -> None:
        self.log.append(f"stream({start}, {count}, take={take}, tiers={tiers})")
        keys = self.keys[start:start + count]
        outs = self.outs[: len(keys)]

        def run():
            got = []
            for chunk in self.store.stream(keys, outs=outs, tiers=tiers):
                got.append(chunk.clone())
                if len(got) == take:
                    break
            return got

        got = self._watched(run)
        for j, chunk in enumerate(got):
            self._check(start + j, chunk, "stream")
        for out in outs:
            out.fill_(SENTINEL)

    def delete(self, i: int) -> None:
        self.log.append(f"delete({i})")
        self.end_write_hang()
        self._watched(lambda: self.store.delete([self.keys[i]]))
        assert self.store.lookup([self.keys[i]]) == 0, f"step {self.steps}: key {i} present after delete"
        self.ok[i], self.survives[i], self.must_survive[i], self.synced_here[i] = {MISS}, set(), False, False
        self._seen(i)

    def drop(self, i: int, tier: str) -> None:
        self.log.append(f"drop({i}, {tier})")
        self.end_write_hang()
        self.store.drop([self.keys[i]], tier)
        if tier != "host":
            self.must_survive[i] = self.synced_here[i] = False

    def pin(self, i: int, ttl_s: float) -> None:
        self.log.append(f"pin({i}, {ttl_s})")
        present = self.store.lookup([self.keys[i]])
        pinned = self.store.pin([self.keys[i]], ttl_s)
        assert pinned == present, f"step {self.steps}: pin of key {i} said {pinned}, lookup {present}"
        if pinned:
            assert self.store.lookup([self.keys[i]]) == 1

    def unpin(self, i: int) -> None:
        self.log.append(f"unpin({i})")
        self.store.unpin([self.keys[i]])

    # -- the APIs the first campaign leaves out ----------------------------------------------

    def borrow(self, i: int) -> None:
        self.log.append(f"borrow({i})")
        cm = self.store.borrow(self.keys[i])
        tensor = cm.__enter__()
        if tensor is None:
            cm.__exit__(None, None, None)
            return
        self._check(i, tensor, "borrow")
        self.held.append((lambda: cm.__exit__(None, None, None), tensor.view(torch.uint8).reshape(-1).numpy().data,
                          bytes(tensor.view(torch.uint8).reshape(-1).numpy().data), f"borrow({i})"))

    def lend(self, start: int, count: int) -> None:
        """``lend`` of one key, or ``lend_many`` of several: each chunk lent is held."""
        self.log.append(f"lend({start}, {count})")
        keys = self.keys[start : start + count]
        if count == 1:
            lent = [one] if (one := self.store.lend(keys[0])) is not None else []
        else:
            lent = self.store.lend_many(keys)
        for i, one in enumerate(lent, start):
            views = self.store.host_pool.views(one.runs)
            data = b"".join(views)
            got = torch.frombuffer(bytearray(data), dtype=torch.float16).view(WALK_NS.chunk_shape)
            self._check(i, got, "lend")

            class Joined:  # every view's bytes, read again at each check
                def __init__(self_inner, views):
                    self_inner.views = views

                def __bytes__(self_inner):
                    return b"".join(bytes(v) for v in self_inner.views)

            self.held.append((one.release, Joined(views), data, f"lend({i})"))

    def release(self, n: int) -> None:
        if not self.held:
            return
        release, view, snapshot, what = self.held.pop(n % len(self.held))
        self.log.append(f"release({what})")
        assert bytes(view) == snapshot, f"step {self.steps}: {what}'s bytes changed while held"
        release()

    def release_all(self) -> None:
        while self.held:
            self.release(0)

    def prefetch(self, start: int, count: int) -> None:
        self.log.append(f"prefetch({start}, {count})")
        keys = self.keys[start:start + count]
        allowed = {k.id: set(self.ok[start + j]) for j, k in enumerate(keys)}
        futures = self.store.prefetch(keys)

        def wait():
            return [f.result(timeout=30) for f in futures]

        blobs = self._watched(wait)
        for blob in blobs:
            if blob is not None:
                header, _ = verify_blob(blob)
                i = next(j for j, k in enumerate(self.keys) if k.id == header.key_id)
                self._check(i, self._decoded(i, blob), "prefetch", allowed[header.key_id])

    def replicas(self, start: int, count: int) -> None:
        self.log.append(f"replicas({start}, {count})")
        keys = self.keys[start:start + count]
        where = self.store.replicas(keys)
        for j, tiers in enumerate(where):
            assert tiers <= {"host", *REPLICA_TIERS}
            assert self.ok[start + j] - {MISS}, f"step {self.steps}: replicas lists deleted key {start + j}"

    # -- faults ---------------------------------------------------------------------------------

    def fail_next_write(self, tier: str) -> None:
        self.log.append(f"fail_next_write({tier})")
        t = self.tiers[tier]
        t.failures["write"] = t.failures.get("write", 0) + 1

    def start_write_hang(self) -> None:
        if self.write_hang is None:
            self.log.append("start_write_hang")
            self.write_hang = self.disk.gates["write"] = Gate()

    def end_write_hang(self) -> None:
        if self.write_hang is not None:
            self.log.append("end_write_hang")
            self.write_hang.open()
            del self.disk.gates["write"]
            self.write_hang = None

    def start_read_hang(self, tier: str) -> None:
        if self.read_hang is None:
            self.log.append(f"start_read_hang({tier})")
            gate = Gate()
            self.read_hang = (tier, gate)
            self.tiers[tier].gates["read"] = gate

    def end_read_hang(self) -> None:
        if self.read_hang is not None:
            tier, gate = self.read_hang
            self.log.append(f"end_read_hang({tier})")
            gate.open()
            del self.tiers[tier].gates["read"]
            self.read_hang = None

    def end_hangs(self) -> None:
        self.end_write_hang()
        self.end_read_hang()

    def flush(self) -> None:
        """Copies finish once no tier hangs: a copy may read its target too (a durable re-put's
        copy to a shared tier reads the value there whole), so a read hang ends as well."""
        self.log.append("flush")
        self.end_hangs()
        assert self.store.flush(timeout_s=30), f"step {self.steps}: copies not done after 30 s"

    def restart(self, power_loss: bool, rng: random.Random) -> None:
        self.log.append(f"restart(power_loss={power_loss})")
        reader = self.reader is not None
        self.end_hangs()
        self.stop_reader()
        self.release_all()
        self.end_hangs()
        self.store.flush()
        self.store.close()
        for i, key in enumerate(self.keys):
            if key.id not in self.disk.unsynced:
                continue
            assert not self.synced_here[i], f"step {self.steps}: key {i}'s durable put left an unsynced file"
            path = self.disk.path_of(key.id)
            if power_loss and rng.random() < 0.5 and path.exists():
                path.write_bytes(b"")
        self.synced_here = [False] * len(self.keys)
        self._open()
        for i, key in enumerate(self.keys):
            out = torch.empty(WALK_NS.chunk_shape, dtype=torch.float16)
            got = out if self.store.get_into(key, out) else None
            allowed = set(self.survives[i]) | ({MISS} if not self.must_survive[i] else set())
            self._check(i, got, "the read after a restart", allowed or {MISS})
            found = next(((v, c) for v in range(VALUES) for c in CODECS
                          if got is not None and self._matches(i, got, {(v, c)})), None)
            self.ok[i] = {MISS} | ({found} if found else set())
            # the index serves one version now; the other tier may still hold another put since
            # the last durable one, which a later restart may serve (each tier keeps its whole
            # file until a newer copy replaces it): only a durable put or a delete ends them
            self.must_survive[i] = self.must_survive[i] and found is not None
        with self.hlock:
            self.history = [[set(ok)] for ok in self.ok]
        if reader:
            self.start_reader(self.steps)


class Reader(threading.Thread):
    """Reads alongside the walk's steps (one thread): every read API, each result checked
    against what the key allowed at some moment while the read ran, its buffers checked
    for late writes, lent bytes checked unchanged while held."""

    def __init__(self, w: Walk, seed: int) -> None:
        super().__init__(daemon=True)
        self.w, self.rng = w, random.Random(seed)
        self.outs = [torch.full(WALK_NS.chunk_shape, SENTINEL, dtype=torch.float16) for _ in w.keys]
        self.error: str | None = None
        self.done = threading.Event()
        self.start()

    def stop(self) -> None:
        self.done.set()
        self.join(30)
        if self.is_alive():
            import sys, traceback
            stack = "".join(traceback.format_stack(sys._current_frames()[self.ident]))
            raise AssertionError(f"the reader thread did not stop; it is at:\n{stack}")

    def run(self) -> None:
        try:
            while not self.done.is_set() and self.error is None:
                self.once()
        except Exception as exc:  # noqa: BLE001
            import traceback
            self.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"

    def _check(self, i: int, got, mark: int, what: str) -> None:
        allowed = self.w.allowed_since(i, mark)
        if not self.w._matches(i, got, allowed):
            self.error = f"{what} of key {i} returned {self.w._which(i, got)}; allowed while it ran {sorted(map(str, allowed))}"

    def _untouched(self, what: str) -> None:
        for j, out in enumerate(self.outs):
            if not bool((out == SENTINEL).all()):
                self.error = f"reader buffer {j} was written after {what} returned"

    def once(self) -> None:
        w, rng, n = self.w, self.rng, len(self.w.keys)
        store = w.store
        i = rng.randrange(n)
        start = rng.randrange(n)
        count = rng.randint(1, n - start)
        r = rng.random()
        self._untouched("an earlier read")
        if r < 0.2:
            mark = w.since(i)
            out = self.outs[i]
            got = out.clone() if store.get_into(w.keys[i], out) else None
            out.fill_(SENTINEL)
            self._check(i, got, mark, "get_into")
        elif r < 0.3:
            mark = w.since(i)
            self._check(i, w._decoded(i, store.get_blob(w.keys[i])), mark, "get_blob")
        elif r < 0.55:
            keys = w.keys[start:start + count]
            marks = [w.since(start + j) for j in range(count)]
            outs = self.outs[:count]
            if rng.random() < 0.5:
                got = store.get_many_into(keys, outs)
                results = [o.clone() for o in outs[:got]]
            else:
                tiers = rng.choice((None, ["disk"], ["pfs"], ["disk", "pfs"], ["host", "disk"]))
                results = [c.clone() for c in store.stream(keys, outs=outs, tiers=tiers)]
            for o in outs:
                o.fill_(SENTINEL)
            for j, got in enumerate(results):
                self._check(start + j, got, marks[j], "get_many_into/stream")
        elif r < 0.65:
            marks = {k.id: (start + j, w.since(start + j)) for j, k in enumerate(w.keys[start:start + count])}
            for future in store.prefetch(w.keys[start:start + count]):
                blob = future.result(timeout=60)
                if blob is not None:
                    header, _ = verify_blob(blob)
                    j, mark = marks[header.key_id]
                    self._check(j, w._decoded(j, blob), mark, "prefetch")
        elif r < 0.8:
            mark = w.since(i)
            with store.borrow(w.keys[i]) as tensor:
                if tensor is None:
                    return
                snapshot = tensor.clone()
                self._check(i, snapshot, mark, "borrow")
                self.done.wait(0.002)
                if not same(tensor, snapshot):
                    self.error = f"borrow of key {i}: the lent bytes changed while held"
        else:
            mark = w.since(i)
            lent = store.lend(w.keys[i])
            if lent is None:
                return
            try:
                data = b"".join(store.host_pool.views(lent.runs))
                self._check(i, torch.frombuffer(bytearray(data), dtype=torch.float16).view(WALK_NS.chunk_shape), mark,
                            "lend")
                self.done.wait(0.002)
                if b"".join(store.host_pool.views(lent.runs)) != data:
                    self.error = f"lend of key {i}: the pinned bytes changed while held"
            finally:
                lent.release()


def step(w: Walk, rng: random.Random) -> None:
    n = len(w.keys)
    r = rng.random()
    i = rng.randrange(n)
    start = rng.randrange(n)
    count = rng.randint(1, n - start)
    if r < 0.22:
        w.put(i, rng.randrange(VALUES), rng.choice(CODECS), rng.random() < 0.3, blob=rng.random() < 0.3)
    elif r < 0.32:
        w.get(i, flip=rng.choice((None, None, None, "disk", "pfs")))
    elif r < 0.36:
        w.get_blob(i)
    elif r < 0.43:
        w.get_many(start, count)
    elif r < 0.50:
        tiers = rng.choice((None, None, ["disk"], ["pfs"], ["disk", "pfs"], ["host", "pfs"]))
        w.stream(start, count, rng.randint(1, count), tiers)
    elif r < 0.55:
        w.delete(i)
    elif r < 0.60:
        w.drop(i, rng.choice(("host", "host", "disk", "pfs")))
    elif r < 0.64:
        w.pin(i, rng.choice((0.01, 0.1, 10.0)))
    elif r < 0.66:
        w.unpin(i)
    elif r < 0.71:
        if len(w.held) < 3:
            w.borrow(i)
    elif r < 0.75:
        if len(w.held) < 3:
            w.lend(start, min(count, 3))
    elif r < 0.80:
        w.release(rng.randrange(8))
    elif r < 0.84:
        w.prefetch(start, count)
    elif r < 0.86:
        w.replicas(start, count)
    elif r < 0.89:
        w.fail_next_write(rng.choice(REPLICA_TIERS))
    elif r < 0.91:
        w.start_write_hang()
    elif r < 0.93:
        w.start_read_hang(rng.choice(REPLICA_TIERS))
    elif r < 0.95:
        w.end_hangs()
    elif r < 0.96:
        w.flush()
    elif r < 0.97:
        if w.reader is None:
            w.start_reader(rng.randrange(1 << 30))
        else:
            w.stop_reader()
    else:
        w.restart(power_loss=rng.random() < 0.5, rng=rng)
    w.after_step()


def walk(seed: int, steps: int) -> None:
    rng = random.Random(seed)
    w = Walk(seed=seed)
    try:
        if seed % 2:
            w.start_reader(seed)
        for _ in range(steps):
            step(w, rng)
    finally:
        w.close()


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_bounded_walk_over_the_apis_the_fault_campaign_leaves_out(seed):
    """Odd seeds run a reader thread beside the walk."""
    walk(seed, 300)


@pytest.mark.long
def test_a_long_walk_over_the_apis_the_fault_campaign_leaves_out():
    steps = int(os.environ.get("KVSTORE_MODEL_STEPS", "20000"))
    seed = int(os.environ.get("KVSTORE_MODEL_SEED", "0"))
    for s in range(seed, seed + max(1, steps // 2000)):
        walk(s, min(steps, 2000))
