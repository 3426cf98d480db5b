"""The daemon's tenant scheduler (kvstore/daemon/tenant_scheduler.py) with a clock the test
moves: a light tenant goes first, a heavy one waits only while another tenant is active, and
a tenant alone never waits."""

from __future__ import annotations

import asyncio

from kvstore.daemon.tenant_scheduler import TenantScheduler


class ManualClock:
    """A monotonic clock that moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def scheduler(clock: ManualClock, max_wait_s: float = 30.0) -> TenantScheduler:
    return TenantScheduler(half_life_s=1.0, idle_s=0.1, max_wait_s=max_wait_s, clock=clock)


def test_a_tenant_alone_never_waits_however_much_it_used():
    clock = ManualClock()
    s = scheduler(clock)

    async def main():
        for _ in range(100):
            async with s.turn("heavy"):
                s.charge("heavy", 1.0)

    asyncio.run(main())
    assert s.delayed == 0


def test_use_halves_every_half_life():
    clock = ManualClock()
    s = scheduler(clock)
    s.charge("a", 4.0)
    clock.advance(2.0)
    assert s.use("a") == 1.0


def test_the_heavy_tenant_waits_only_while_another_tenant_is_active():
    clock = ManualClock()
    s = scheduler(clock)
    s.charge("heavy", 1.0)
    s.charge("light", 0.1)

    async def main():
        async with s.turn("light"):
            assert s.must_wait("heavy"), "over its share while the light tenant has work"
        assert s.must_wait("heavy"), "the light tenant ended a piece less than idle_s ago"
        clock.advance(0.2)
        assert not s.must_wait("heavy"), "the light tenant is idle: nobody to make room for"
        assert not s.must_wait("light")

    asyncio.run(main())


def test_a_tenant_within_its_share_waits_for_a_lighter_tenant_s_work():
    """Three tenants: b used less than its share, but more than c, whose piece is in flight."""
    clock = ManualClock()
    s = scheduler(clock)
    s.charge("a", 1.0)
    s.charge("b", 0.3)
    s.charge("c", 0.1)

    async def main():
        async with s.turn("a"):  # a is active too: it ended a piece just now
            pass
        async with s.turn("c"):
            assert s.must_wait("b")
            assert not s.must_wait("c")
        assert not s.must_wait("b"), "c's work is done: b is within its share"
        assert s.must_wait("a"), "a is over its share while b and c are active"

    asyncio.run(main())


def test_the_light_tenant_goes_first_and_the_heavy_one_after_it():
    """The heavy tenant's piece, asked first, starts only once the light tenant's pieces have
    brought their uses level; the light tenant's pieces start at once."""
    clock = ManualClock()
    s = scheduler(clock)
    s.charge("heavy", 1.0)
    order = []

    async def piece(label: str, cost: float):
        async with s.turn(label):
            order.append(label)
            s.charge(label, cost)

    async def main():
        light_first = asyncio.ensure_future(piece("light", 0.0))  # active: a piece in flight
        heavy = asyncio.ensure_future(piece("heavy", 0.1))
        await asyncio.sleep(0)
        assert not heavy.done()
        await light_first
        for _ in range(4):  # the light tenant's work (1.2 s) brings it past the heavy one (1.0 s)
            assert not heavy.done()
            await piece("light", 0.3)
            await asyncio.sleep(0)
        await asyncio.wait_for(heavy, 5)

    asyncio.run(main())
    assert order == ["light"] * 5 + ["heavy"], order
    assert s.delayed == 1


def test_a_wait_ends_after_max_wait_s_not_in_a_refusal():
    clock = ManualClock()
    s = scheduler(clock, max_wait_s=0.0)
    s.charge("heavy", 1.0)

    async def main():
        async with s.turn("light"):
            async with s.turn("heavy"):
                return "served"

    assert asyncio.run(main()) == "served"
    assert s.delayed == 1
