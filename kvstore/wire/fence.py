"""Waiting for work handed to another thread before letting a cancellation through.

A copy or a read running in an executor thread may be writing into memory somebody else
owns once we give up (a client's slot, a caller's tensor). Cancelling the asyncio task that
awaits it does not stop the thread, so ``fenced`` waits for the thread first, even through
further cancellations, and only then raises the cancellation.
"""

from __future__ import annotations

import asyncio
from typing import Callable


async def fenced(future: asyncio.Future, abandoned: Callable[[object], None] = lambda result: None):
    """The result of an executor ``future``. If the awaiting task is cancelled meanwhile, the
    thread is waited for first, ``abandoned`` gets what it returned, then the cancellation is
    raised."""
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            try:
                await asyncio.wait([future])
            except asyncio.CancelledError:
                continue
        if not future.cancelled() and future.exception() is None:
            abandoned(future.result())
        raise
