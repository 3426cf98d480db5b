"""A member's lease (kvstore/cluster/lease.py) on a clock the test drives: how long it holds after a
beat, and the new term a beat answered after it ran out starts."""

import pytest

from kvstore.cluster.lease import Lease
from tiers.base import TierError, TierUnavailable


def driven(member_ttl_s=10.0):
    now = [100.0]
    return Lease(member_ttl_s, clock=lambda: now[0]), now


def beat_taking(now, seconds):
    """A beat whose reply comes ``seconds`` after it was sent."""
    def beat():
        now[0] += seconds
        return "answer"
    return beat


def test_a_lease_holds_until_nine_tenths_of_member_ttl_after_the_beat_was_sent():
    lease, now = driven()
    with pytest.raises(TierUnavailable):  # before the first join: nothing may be deleted
        lease.check(lease.term, "delete")
    assert lease.renew(beat_taking(now, 2.0)) == "answer"  # sent at 100, answered at 102
    term = lease.term
    now[0] = 108.99
    lease.check(term, "delete")
    now[0] = 109.0
    with pytest.raises(TierUnavailable):
        lease.check(term, "delete")


def test_a_beat_answered_after_the_lease_ran_out_starts_a_new_term():
    lease, now = driven()
    lease.renew(beat_taking(now, 0.0))
    granted = lease.term  # a delete the ledger grants now
    lease.renew(beat_taking(now, 5.0))  # answered in time: the same term
    assert lease.term == granted
    now[0] += 20.0  # a pause past member_ttl_s
    lease.renew(beat_taking(now, 0.0))
    lease.check(lease.term, "delete")  # a delete granted from now on may go
    with pytest.raises(TierUnavailable):  # the one granted before the pause may not
        lease.check(granted, "delete")


def test_a_failed_beat_renews_nothing():
    lease, now = driven()
    lease.renew(beat_taking(now, 0.0))
    term = lease.term

    def failing():
        raise TierError("cluster ledger: beat: Redis unreachable")
    now[0] += 8.0
    with pytest.raises(TierError):
        lease.renew(failing)
    now[0] += 1.0
    with pytest.raises(TierUnavailable):
        lease.check(term, "delete")
