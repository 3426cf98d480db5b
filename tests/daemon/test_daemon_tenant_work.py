"""kvstore/daemon/tenant_work.py: a tenant's work in pieces of at most 512 keys, each charged
to it, and a request's steps on the event loop charged too."""

from __future__ import annotations

import asyncio
import operator
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvstore.daemon.tenant_scheduler import TenantScheduler
from kvstore.daemon.tenant_work import PIECE_KEYS, TenantWork


def work(executor: ThreadPoolExecutor) -> TenantWork:
    return TenantWork(executor, TenantScheduler(half_life_s=1e9, idle_s=0.05, max_wait_s=1.0))


def spin(seconds: float) -> None:
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


def test_keys_run_in_pieces_of_at_most_512_each_charged_to_its_tenant():
    with ThreadPoolExecutor(2) as executor:
        w = work(executor)
        keys = list(range(2 * PIECE_KEYS + 1))

        def piece(part: list[int]) -> int:
            spin(0.002)
            return len(part)

        sizes = asyncio.run(w.in_pieces("a", piece, keys))
    assert sizes == [PIECE_KEYS, PIECE_KEYS, 1]
    assert w.scheduler.use("a") >= 3 * 0.002 and w.scheduler.use("b") == 0.0
    assert w.inflight == 0


def test_a_prefix_count_stops_at_the_first_piece_that_is_not_whole():
    with ThreadPoolExecutor(2) as executor:
        w = work(executor)
        present = set(range(PIECE_KEYS + 7))
        asked = []

        def lookup(part: list[int]) -> int:
            asked.append(len(part))
            return next((i for i, k in enumerate(part) if k not in present), len(part))

        counts = asyncio.run(w.in_pieces("a", lookup, list(range(4 * PIECE_KEYS)), until=operator.lt))
    assert sum(counts) == PIECE_KEYS + 7 and asked == [PIECE_KEYS, PIECE_KEYS]


def test_a_request_s_steps_on_the_event_loop_are_charged_and_its_errors_pass_through():
    with ThreadPoolExecutor(1) as executor:
        w = work(executor)

        async def request():
            spin(0.003)
            await asyncio.sleep(0)
            spin(0.003)
            raise ValueError("the request's own error")

        with pytest.raises(ValueError, match="own error"):
            asyncio.run(w.charged("a", request()))
    assert w.scheduler.use("a") >= 0.006
