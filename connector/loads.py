"""One request's load: its chunks read from the store into staging buffers by the loader
threads, a few chunks per read call, and scattered into the request's blocks.

Direct loads scatter each group of chunks (all layers at once) as soon as its read
returns, so reading and scattering overlap across the loader threads. Into a CPU cache,
chunks a store lends (``LendsChunks``: the in-process Store, for raw chunks in host RAM) are
scattered straight from the store's pages, with no staging copy, in order on one thread
(each copy uses every core already): the engine's own for a synchronous load, which would
only wait, else a loader thread; what it does not lend is read as above. Into a GPU cache,
lent chunks (host RAM registered for DMA) are scattered on the loader threads, group by
group. A store that hands chunks over during a read (``HandsOverChunks``: the daemon's
Client, from the daemon's host pool mapped here) has each group's chunks scattered as they
are handed over (into a GPU cache, only from that memory registered for DMA), again with no
staging copy: for a synchronous load from the daemon's host pool group after group on the
engine's thread, so that every copy into the CPU cache runs with the engine's own threads
(``_run_here``), else (an asynchronous load, or a remote daemon: there the loader threads
overlap receiving and scattering) on the loader threads. Layer-wise loads keep the staged
chunks until every read is in, then scatter layer by layer on a thread of their own, so
layer ``i`` lands while the model computes layer ``i - 1``.

Who may write what: a group's buffers belong to its read call until the call returns; the
request's destination blocks belong to the load until ``finish`` returns. ``finish`` (the
result is known, or the deadline passed) abandons reads still in flight: when they return
they scatter nothing. After a read that came back short the buffers are discarded, never
reused (the Store may still be writing them: see docs/connector.md).
"""

from __future__ import annotations

import enum
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from threading import Condition

import torch

from connector.availability import Availability
from connector.metadata import ChunkLoad, LoadResult, RequestLoad
from connector.staging import StagingPool
from connector.transfer import ChunkMover
from kvstore.api import ChunkStore, HandsOverChunks, LendsChunks


class GroupState(enum.Enum):
    QUEUED = "queued"
    READING = "reading"
    SCATTERING = "scattering"
    STAGED = "staged"  # layer-wise: read, waiting for the layer scatter
    DONE = "done"  # every chunk of the group is in place (or staged, layer-wise)
    SHORT = "short"  # the read stopped at a chunk it could not load; the leading ``got`` are usable
    ABANDONED = "abandoned"


@dataclass
class _Group:
    chunks: list[ChunkLoad]
    state: GroupState = GroupState.QUEUED
    got: int = 0  # leading chunks read (and, for direct loads, scattered)
    bufs: list[torch.Tensor] = field(default_factory=list)


RESOLVED = (GroupState.DONE, GroupState.SHORT)
# A read call on the engine's thread names at most this many chunk bytes: where the daemon's
# slots are smaller than a chunk (or the daemon is remote) the Client receives a call's chunks
# into fresh buffers before handing any over, so a long prompt in one call would hold all of
# its KV at once. 256 MiB is a 2k-token hit of a 7B model in one call (a round trip each
# saved 1-3 ms in vLLM), and bounds what a 128k-token prompt holds.
HERE_READ_BYTES = 256 << 20


def _groups(chunks: list[ChunkLoad], per_read: int) -> list[_Group]:
    """``chunks`` in read calls of up to ``per_read``; one read call names one namespace (the
    daemon's Client refuses a mix), so a session's tail, in a namespace of its own, is a group
    of its own."""
    groups: list[_Group] = []
    for chunk in chunks:
        last = groups[-1] if groups else None
        if last is None or len(last.chunks) == per_read or last.chunks[0].key.namespace != chunk.key.namespace:
            groups.append(_Group([chunk]))
        else:
            last.chunks.append(chunk)
    return groups


class LoadTask:
    def __init__(self, request: RequestLoad, store: ChunkStore, staging: StagingPool, mover: ChunkMover,
                 availability: Availability, cond: Condition, chunks_per_read: int, timeout_s: float,
                 layerwise: bool, lends_to_gpu: bool = False) -> None:
        """``lends_to_gpu``: the store's lent chunks are a DMA source for the GPU cache
        (``LendsChunks.prepare_lending`` said so); else a GPU cache loads through pinned staging."""
        self.request = request
        self.store, self.staging, self.mover, self.availability = store, staging, mover, availability
        self.cond = cond  # shared by the worker's tasks: any group's progress wakes its waiters
        self.layerwise = layerwise
        # Direct loads borrow chunks from a store that lends them, into a GPU cache only from
        # host RAM registered for DMA; layer-wise loads keep staged chunks.
        self.lends = isinstance(store, LendsChunks) and not layerwise and (lends_to_gpu or not mover.cuda)
        # into a GPU cache only from the daemon's shared memory registered for DMA
        self.hands_over = isinstance(store, HandsOverChunks) and not layerwise and (
            not mover.cuda or store.hands_over_in_place(mover.device))
        self.groups = _groups(request.chunks, chunks_per_read)
        self.started = time.perf_counter()
        self.deadline = time.monotonic() + timeout_s
        self.error: BaseException | None = None
        self.result: LoadResult | None = None

    def submit(self, pool: Executor, here: bool = False) -> None:
        """Start the load on the loader threads; with ``here`` (a synchronous load: the
        caller would only wait) the chunks the store lends are scattered on the calling
        thread before this returns, and only the reads go to the pool; a store that hands
        chunks over in place is read and scattered on the calling thread alone (``_run_here``);
        one that receives each read call whole first (a remote daemon) goes to the loader
        threads, where receiving one group overlaps scattering another. Into a GPU cache every
        group goes to the loader threads, lent, handed over or not: each thread's copies run on
        its own stream, and two streams in flight fill the link that one leaves idle between
        copies (on an H200, chunks handed over from a daemon reached 30 GB/s on the calling
        thread alone, whatever the read size, against a 55 GB/s link)."""
        if self.lends and not self.mover.cuda:
            if here:
                self._run_lent_first(pool)
            else:
                pool.submit(self._run_lent_first, pool)
            return
        if self.hands_over and here and not self.mover.cuda and self.store.hands_over_in_place():
            chunk_bytes = self.request.chunks[0].key.namespace.chunk_bytes
            self.groups = _groups(self.request.chunks, max(1, HERE_READ_BYTES // chunk_bytes))
            self._run_here()
            return
        for group in self.groups:
            pool.submit(self._run, group)

    # -- loader threads ---------------------------------------------------------------------

    def _run_lent_first(self, pool: Executor) -> None:
        """Scattering a lent chunk is a memory copy that already uses every core, so one
        thread scatters them in order (two at once only contend for the same memory
        bandwidth); from the first group the store does not lend whole, the groups left are
        reads, and go to the pool to run side by side."""
        for i, group in enumerate(self.groups):
            if not self._run(group):
                for rest in self.groups[i + 1:]:
                    pool.submit(self._run, rest)
                return

    def _run_here(self) -> None:
        """The groups in order on the engine's thread, up to the first that comes back short
        or the deadline; groups as large as ``HERE_READ_BYTES`` allows, as one thread gains
        nothing from splitting a read but round trips. Why not the loader threads: a torch copy on another thread
        runs on an OpenMP thread team of that thread's own, and in vLLM's CPU Worker (its
        OpenMP threads bound one per core) those extra teams slowed every later forward
        (docs/vllm.md, "Where a hit's time goes"); the engine's thread copies with the team
        the forward uses, and would only wait meanwhile."""
        for group in self.groups:
            if time.monotonic() >= self.deadline:
                return  # the rest is abandoned by ``finish``: a timed-out load, as on the loader threads
            self._run(group)
            if group.state is not GroupState.DONE:
                return

    def _run(self, group: _Group) -> bool:
        """Load one group; whether the store lent all of it."""
        with self.cond:
            if group.state is GroupState.ABANDONED:
                return False
            group.state = GroupState.READING
        if self.hands_over:
            self._run_handed_over(group)
            return False
        lent, failed = self._scatter_lent(group) if self.lends else (0, False)
        if lent is None:
            return False
        if lent == len(group.chunks):
            with self.cond:
                if group.state is GroupState.ABANDONED:
                    return False
                group.got, group.state = lent, GroupState.DONE
                self.cond.notify_all()
            return True
        rest = [] if failed else group.chunks[lent:]
        bufs = [self.staging.take() for _ in rest]
        got = self._read(rest, bufs) if rest else 0
        with self.cond:
            if group.state is GroupState.ABANDONED:
                self._release(bufs, got == len(bufs))
                return False
            group.got = lent + got
            if self.layerwise:
                group.bufs = bufs
                group.state = GroupState.STAGED if got == len(bufs) else GroupState.SHORT
                self.cond.notify_all()
                return False
            group.state = GroupState.SCATTERING
        try:
            for buf, chunk in zip(bufs[:got], rest):
                self.mover.scatter(buf, chunk)
        except BaseException as exc:  # a bug, not a store failure: re-raised by finish()
            self.error, group.got = exc, 0
        finally:
            self._release(bufs, got == len(bufs))
            with self.cond:
                group.state = GroupState.DONE if group.got == len(group.chunks) else GroupState.SHORT
                self.cond.notify_all()
        return False

    def _scatter_lent(self, group: _Group) -> tuple[int | None, bool]:
        """Scatter the group's leading chunks straight from the store's host RAM (one copy,
        no staging buffer) while the store lends them: (how many, or None if the load was
        abandoned meanwhile; whether the store failed). The blocks are written only in state
        SCATTERING, which ``finish`` waits out, so nothing writes them once the load is settled."""
        n = 0
        for chunk in group.chunks:
            try:
                with self.store.borrow(chunk.key) as src:
                    if src is None:
                        break
                    with self.cond:
                        if group.state is GroupState.ABANDONED:
                            return None, False
                        group.state = GroupState.SCATTERING
                    try:
                        self.mover.scatter(src, chunk)
                    except BaseException as exc:  # a bug: re-raised by finish(), nothing usable
                        self.error = exc
                        with self.cond:
                            group.state = GroupState.SHORT
                            self.cond.notify_all()
                        return None, False
                    with self.cond:
                        group.state = GroupState.READING
                        self.cond.notify_all()
            except Exception as exc:  # the store failed: the rest is a miss, and a back-off
                self.availability.failed("get", exc)
                return n, True
            n += 1
        return n, False

    def _run_handed_over(self, group: _Group) -> None:
        """One read call; each chunk is scattered while the store hands it over, straight
        from the store's memory. Blocks are written only in state SCATTERING, which
        ``finish`` waits out; once the load is abandoned the rest is refused."""

        def scatter(index: int, src: torch.Tensor) -> bool:
            with self.cond:
                if group.state is GroupState.ABANDONED:
                    return False
                group.state = GroupState.SCATTERING
            try:
                self.mover.scatter(src, group.chunks[index])
            except BaseException as exc:  # a bug, not a store failure: re-raised by finish()
                self.error, group.got = exc, 0
                with self.cond:
                    group.state = GroupState.SHORT
                    self.cond.notify_all()
                return False
            with self.cond:
                group.got, group.state = index + 1, GroupState.READING
                self.cond.notify_all()
            return True

        try:
            self.store.get_with([c.key for c in group.chunks], scatter)
        except (ValueError, TypeError) as exc:  # our keys do not fit the store: a bug
            self.error = exc
        except Exception as exc:  # the store failed: the rest is a miss, and a back-off
            self.availability.failed("get", exc)
        with self.cond:
            if group.state is not GroupState.ABANDONED:
                group.state = GroupState.DONE if group.got == len(group.chunks) else GroupState.SHORT
            self.cond.notify_all()

    def _read(self, chunks: list[ChunkLoad], bufs: list[torch.Tensor]) -> int:
        keys = [c.key for c in chunks]
        try:
            if len(keys) == 1:
                return int(self.store.get_into(keys[0], bufs[0]))
            return self.store.get_many_into(keys, bufs)
        except (ValueError, TypeError) as exc:  # our buffers do not fit our namespace: a bug
            self.error = exc
        except Exception as exc:  # the store failed: a miss for every chunk, and a back-off
            self.availability.failed("get", exc)
        return 0

    def _release(self, bufs: list[torch.Tensor], complete: bool) -> None:
        for buf in bufs:
            (self.staging.give if complete else self.staging.discard)(buf)

    # -- the engine's side -------------------------------------------------------------------

    def _usable(self) -> tuple[int, bool]:
        """(leading chunks in place or staged, whether that number can no longer grow)."""
        n = 0
        for group in self.groups:
            if group.state not in RESOLVED and group.state is not GroupState.STAGED:
                return n, False
            n += group.got
            if group.got < len(group.chunks):
                return n, True
        return n, True

    def known(self) -> bool:
        """Whether the result is settled: every chunk arrived, or one before all others failed."""
        return self._usable()[1]

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def wait(self) -> None:
        """Until the result is settled or the deadline passes (the shared condition held)."""
        while not self.known():
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                return
            self.cond.wait(remaining)

    def finish(self) -> LoadResult:
        """Settle the load (the shared condition held): abandon reads still in flight, wait for
        scatters under way (memory copies, no I/O), and report what is in place."""
        timed_out = not self.known()
        while True:
            # A lent chunk's scatter ends in READING (the group's next chunk is still to
            # come), so every wait is followed by another pass: settled means no group can
            # take another step, not only that none is scattering now.
            for group in self.groups:
                if group.state in (GroupState.QUEUED, GroupState.READING):
                    group.state = GroupState.ABANDONED
            if not any(g.state is GroupState.SCATTERING for g in self.groups):
                break
            self.cond.wait()
        if self.error is not None:
            raise self.error
        n, _ = self._usable()
        chunks = self.request.chunks
        failed = tuple(b for c in chunks[n:] for b in c.block_ids)
        self.result = LoadResult(
            self.request.request_id, loaded_chunks=n,
            loaded_tokens=sum(len(c.block_ids) for c in chunks[:n]) * self.mover.block_size,
            failed_block_ids=failed, seconds=time.perf_counter() - self.started,
            bytes=n * self.staging.nbytes, timed_out=timed_out)
        return self.result

    def staged(self) -> list[tuple[torch.Tensor, ChunkLoad]]:
        """Layer-wise: the usable staged chunks and their loads, in order (after ``finish``)."""
        out = []
        for group in self.groups:
            out += list(zip(group.bufs[:group.got], group.chunks))
        return out[: self.result.loaded_chunks]

    def release_staged(self) -> None:
        """Layer-wise: give back every group's staged buffers once the layer scatter is done."""
        for group in self.groups:
            self._release(group.bufs, group.got == len(group.chunks))
            group.bufs = []
