"""The daemon's tenant scheduler (kvstore/daemon/tenant_scheduler.py) with a clock the test
moves: a tenant over its share of the interpreter waits, and only while another tenant is
active; the light tenant goes first; a tenant alone never waits."""

from __future__ import annotations

import asyncio
import math

from kvstore.daemon.tenant_scheduler import TenantScheduler

HALF_LIFE_S = 1.0
FULL = HALF_LIFE_S / math.log(2)  # the use of a tenant that has held the whole interpreter


class ManualClock:
    """A monotonic clock that moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def scheduler(clock: ManualClock, max_wait_s: float = 30.0) -> TenantScheduler:
    return TenantScheduler(half_life_s=HALF_LIFE_S, idle_s=0.1, max_wait_s=max_wait_s, clock=clock)


def test_a_tenant_alone_never_waits_however_much_it_used():
    clock = ManualClock()
    s = scheduler(clock)

    async def main():
        for _ in range(100):
            async with s.turn("heavy"):
                s.charge("heavy", FULL)

    asyncio.run(main())
    assert s.delayed == 0


def test_use_halves_every_half_life_and_rate_is_the_share_of_the_interpreter():
    clock = ManualClock()
    s = scheduler(clock)
    s.charge("a", 4.0)
    clock.advance(2 * HALF_LIFE_S)
    assert s.use("a") == 1.0
    s.charge("b", 0.6 * FULL)
    assert math.isclose(s.rate("b"), 0.6)


def test_the_heavy_tenant_waits_only_while_another_tenant_is_active():
    clock = ManualClock()
    s = scheduler(clock)
    s.charge("heavy", 0.8 * FULL)

    async def main():
        assert not s.must_wait("heavy"), "nobody else is active"
        async with s.turn("light"):
            assert s.must_wait("heavy"), "over its share (0.5) while the light tenant has work"
        assert s.must_wait("heavy"), "the light tenant ended a piece less than idle_s ago"
        clock.advance(0.2)
        assert not s.must_wait("heavy"), "the light tenant is idle: nobody to make room for"

    asyncio.run(main())


def test_a_tenant_within_its_share_never_waits_even_if_it_used_more_than_the_others():
    """A well-behaved tenant may use more of the daemon than an abusive one held to its key
    rate: it is not paced for that."""
    clock = ManualClock()
    s = scheduler(clock)
    s.charge("steady", 0.45 * FULL)
    s.charge("flood", 0.05 * FULL)

    async def main():
        async with s.turn("flood"):
            assert not s.must_wait("steady")
        async with s.turn("steady"):
            assert not s.must_wait("flood")

    asyncio.run(main())
    assert s.delayed == 0


def test_the_share_is_the_interpreter_divided_among_the_active_tenants():
    clock = ManualClock()
    s = scheduler(clock)
    s.charge("a", 0.4 * FULL)

    async def main():
        async with s.turn("b"):
            assert not s.must_wait("a"), "two active: a share of 0.5"
            async with s.turn("c"):
                assert s.must_wait("a"), "three active: a share of 0.33"

    asyncio.run(main())


def test_the_light_tenant_goes_first_and_the_heavy_one_once_its_use_decayed():
    """The heavy tenant's piece, asked first, waits; the light tenant's pieces start at once;
    the heavy one starts once its rate has decayed to its share."""
    clock = ManualClock()
    s = scheduler(clock)
    s.charge("heavy", 0.8 * FULL)
    order = []

    async def piece(label: str):
        async with s.turn(label):
            order.append(label)
            s.charge(label, 0.001)

    async def main():
        async with s.turn("light"):  # the light tenant is active
            heavy = asyncio.ensure_future(piece("heavy"))
            await asyncio.sleep(0)
            for _ in range(3):
                await piece("light")
                await asyncio.sleep(0)
            assert not heavy.done()
            clock.advance(HALF_LIFE_S)  # 0.8 -> 0.4: within its share, seen at its next look
            await asyncio.wait_for(heavy, 5)

    asyncio.run(main())
    assert order == ["light"] * 3 + ["heavy"], order
    assert s.delayed == 1


def test_a_wait_ends_after_max_wait_s_not_in_a_refusal():
    clock = ManualClock()
    s = scheduler(clock, max_wait_s=0.0)
    s.charge("heavy", FULL)

    async def main():
        async with s.turn("light"):
            async with s.turn("heavy"):
                return "served"

    assert asyncio.run(main()) == "served"
    assert s.delayed == 1


def test_waiting_pieces_sleep_through_the_other_tenants_work():
    """Only time lowers a tenant's rate, so a waiting piece looks again only when its rate may
    be within its share, whatever the others do meanwhile; and of a tenant's waiting pieces
    one looks, the others behind it. Waiters that looked again on every charge of every
    tenant (a Get's reads ahead wait side by side) would take the daemon's event loop, and
    the light tenant's requests would wait behind them."""
    clock = ManualClock()
    s = scheduler(clock)
    s.charge("heavy", FULL)
    looks = []
    must_wait = s.must_wait

    def counted(label: str) -> bool:
        looks.append(label)
        return must_wait(label)

    s.must_wait = counted

    async def heavy_piece():
        async with s.turn("heavy"):
            pass

    async def main():
        async with s.turn("light"):
            waiting = [asyncio.ensure_future(heavy_piece()) for _ in range(3)]
            await asyncio.sleep(0)
            for _ in range(300):
                async with s.turn("light"):
                    s.charge("light", 0.0001)
                await asyncio.sleep(0)
            assert not any(w.done() for w in waiting)
            for w in waiting:
                w.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)

    asyncio.run(main())
    assert looks.count("heavy") <= 10, f"the heavy tenant's pieces looked {looks.count('heavy')} times"
