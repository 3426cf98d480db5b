"""kvstore/daemon/read_grants.py: the tenant with the fewest reads running gets the next
free place, and its earliest Get waiting; a cancelled waiter takes none, and places are never
lost or made up."""

import asyncio

import pytest
from hypothesis import given, settings, strategies as st

from kvstore.daemon.read_grants import ReadGrants


def run(coro):
    return asyncio.run(coro)


def test_a_free_place_goes_to_the_earliest_get_not_the_first_to_ask():
    async def main():
        grants = ReadGrants(1)
        early, late = grants.next_get(), grants.next_get()
        order = []
        release = asyncio.Event()

        async def read(get: int, name: str):
            async with grants.hold("t", get):
                order.append(name)
                await release.wait()

        holder = asyncio.create_task(read(late, "late holds"))
        await asyncio.sleep(0)
        waiters = [asyncio.create_task(read(late, "late again")), asyncio.create_task(read(early, "early"))]
        await asyncio.sleep(0)
        assert grants.waiting == 2
        release.set()
        await asyncio.gather(holder, *waiters)
        return order, grants.free

    order, free = run(main())
    assert order == ["late holds", "early", "late again"]
    assert free == 1


def test_a_tenants_burst_does_not_queue_another_tenants_get_behind_it():
    async def main():
        grants = ReadGrants(2)
        order = []
        gates = {}

        async def read(tenant, get, name):
            async with grants.hold(tenant, get):
                order.append(name)
                gates[name] = asyncio.Event()
                await gates[name].wait()

        burst = [grants.next_get() for _ in range(4)]
        tasks = [asyncio.create_task(read("a", g, f"a{i}")) for i, g in enumerate(burst)]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(read("b", grants.next_get(), "b0")))
        await asyncio.sleep(0)
        assert order == ["a0", "a1"] and grants.waiting == 3
        gates["a0"].set()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert order == ["a0", "a1", "b0"]  # b runs nothing, a runs one: b's turn, though a2 asked first
        for name in ("a1", "b0"):
            gates[name].set()
        for _ in range(4):
            await asyncio.sleep(0)
        for name in ("a2", "a3"):
            gates[name].set()
        await asyncio.gather(*tasks)
        return order, grants.free, grants.running

    order, free, running = run(main())
    assert order == ["a0", "a1", "b0", "a2", "a3"]
    assert (free, running) == (2, {})


def test_a_cancelled_waiter_takes_no_place_and_an_error_gives_its_place_back():
    async def main():
        grants = ReadGrants(1)
        get = grants.next_get()
        gate = asyncio.Event()

        async def hold_until_gate():
            async with grants.hold("t", get):
                await gate.wait()

        holder = asyncio.create_task(hold_until_gate())
        await asyncio.sleep(0)
        waiter = asyncio.create_task(hold_until_gate())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        gate.set()
        await holder
        with pytest.raises(RuntimeError):
            async with grants.hold("t", get):
                raise RuntimeError("a read failed")
        return grants.free, grants.waiting

    assert run(main()) == (1, 0)


def test_a_place_granted_as_its_waiter_is_cancelled_passes_to_the_next():
    async def main():
        grants = ReadGrants(1)
        a, b = grants.next_get(), grants.next_get()
        got = []
        gates = {name: asyncio.Event() for name in ("holder", "first", "second")}

        async def read(get, name):
            async with grants.hold("t", get):
                got.append(name)
                await gates[name].wait()

        holder = asyncio.create_task(read(a, "holder"))
        await asyncio.sleep(0)
        first = asyncio.create_task(read(a, "first"))
        second = asyncio.create_task(read(b, "second"))
        await asyncio.sleep(0)
        gates["holder"].set()
        await asyncio.sleep(0)  # the holder ends: its place is granted to "first", which has not run yet
        assert not first.done() and got == ["holder"]
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        gates["second"].set()
        await asyncio.wait_for(second, 5)
        await holder
        return got, grants.free

    assert run(main()) == (["holder", "second"], 1)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.booleans(), st.integers(0, 2)),
                                    max_size=25))
def test_never_more_reads_at_once_than_places_and_none_lost(places, reads):
    async def main():
        grants = ReadGrants(places)
        orders = [grants.next_get() for _ in range(6)]
        running = peak = 0

        async def read(get, naps, _cancelled_below, tenant):
            nonlocal running, peak
            async with grants.hold(f"tenant{tenant}", orders[get]):
                running += 1
                peak = max(peak, running)
                try:
                    for _ in range(naps):
                        await asyncio.sleep(0)
                finally:
                    running -= 1

        tasks = [asyncio.create_task(read(*r)) for r in reads]
        await asyncio.sleep(0)
        for task, (_, _, cancel_me, _) in zip(tasks, reads):
            if cancel_me:
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return peak, grants.free, grants.waiting, grants.running

    peak, free, waiting, running = run(main())
    assert peak <= places
    assert (free, waiting, running) == (places, 0, {})
