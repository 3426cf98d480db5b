"""Where every piece of a tenant's request work runs: Store calls in the bounded executor
(so the event loop never blocks on file I/O or large copies), per-key work on the event loop,
each after its tenant's turn (kvstore/daemon/tenant_scheduler.py) and charged to it.

What a piece took is the CPU time of the thread that ran it (``time.thread_time``): an
executor call, or a step of the request's handling on the event loop. Wall time would also
count the time a piece waited for the interpreter lock, or the disk, or for the CPU while the
machine's other processes had it: on a busy machine every tenant would seem to use more than
its share, the well-behaved one too. Requests naming many keys are run in pieces of ``PIECE_KEYS`` keys, so another tenant's
piece never waits behind a long one (a Contains of 4,096 keys held the interpreter ~4 ms).
"""

from __future__ import annotations

import asyncio
import functools
import time
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from kvstore.daemon.tenant_scheduler import TenantScheduler
from kvstore.wire.fence import fenced

PIECE_KEYS = 512  # keys bound, or looked up, pinned, deleted, in one piece (~0.5 ms)


def _timed(call: Callable[[], object]) -> tuple[object, float]:
    start = time.thread_time()
    result = call()
    return result, time.thread_time() - start


@types.coroutine
def _charged(awaitable, charge: Callable[[float], None]):
    """Await ``awaitable``, passing ``charge`` the CPU time of each of its steps (those between
    its waits: what it took of the event loop)."""
    steps = awaitable.__await__()
    sent, thrown = None, None
    while True:
        start = time.thread_time()
        try:
            waiting_on = steps.send(sent) if thrown is None else steps.throw(thrown)
        except StopIteration as done:
            return done.value
        finally:
            charge(time.thread_time() - start)
        try:
            sent, thrown = (yield waiting_on), None
        except BaseException as exc:  # a cancellation, or a future's error: the awaitable's to handle
            sent, thrown = None, exc


class TenantWork:
    def __init__(self, executor: ThreadPoolExecutor, scheduler: TenantScheduler) -> None:
        self.executor, self.scheduler = executor, scheduler
        self.inflight = 0  # executor calls queued, waiting for their turn or running

    async def run(self, label: str, fn, *args, abandoned: Callable[[object], None] = lambda result: None):
        """``fn(*args)`` in the executor once tenant ``label`` has its turn, fenced
        (kvstore/wire/fence.py): ``abandoned`` gets the result of a call whose awaiting task
        was cancelled meanwhile."""
        loop = asyncio.get_running_loop()
        self.inflight += 1
        try:
            async with self.scheduler.turn(label):
                call = functools.partial(_timed, functools.partial(fn, *args))
                result, seconds = await fenced(loop.run_in_executor(self.executor, call),
                                               lambda timed: abandoned(timed[0]))
                self.scheduler.charge(label, seconds)
                return result
        finally:
            self.inflight -= 1

    async def on_loop(self, label: str, fn, *args):
        """``fn(*args)`` on the event loop once tenant ``label`` has its turn (work too small
        to hand to a thread, such as binding a batch of keys); ``charged`` counts its time."""
        async with self.scheduler.turn(label):
            return fn(*args)

    async def charged(self, label: str, awaitable):
        """Await ``awaitable`` (a request's handling on the event loop), charging tenant
        ``label`` the event-loop time its steps take."""
        return await _charged(awaitable, functools.partial(self.scheduler.charge, label))

    async def in_pieces(self, label: str, fn, keys: Sequence, *args, until: Callable[[object, int], bool] = None) -> list:
        """``fn(piece, *args)`` for each piece of ``PIECE_KEYS`` of ``keys``, in order, each
        in the executor in its own turn: the pieces' results. ``until(result, n)``: stop after
        a piece whose result says so (``n``: the piece's keys)."""
        results = []
        for first in range(0, len(keys), PIECE_KEYS):
            piece = keys[first : first + PIECE_KEYS]
            results.append(await self.run(label, fn, piece, *args))
            if until is not None and until(results[-1], len(piece)):
                break
        return results
