"""The daemon's book of paused sessions: per owner, bounded, forgotten with their lease."""

import math

import pytest

from kvstore.daemon.sessions import SessionBook
from kvstore.api import MAX_PIN_S, MIN_PIN_S, pin_ttl, valid_duration


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_record_lives_as_long_as_its_longest_lease():
    clock = Clock()
    book = SessionBook(clock=clock)
    book.pause("t", "s", "ns", ["a", "b"], 10.0)
    book.pause("t", "s", "ns", ["a", "b"], 2.0)  # a lease extends, never shortens
    clock.now = 9.0
    assert book.resume("t", "s", 5.0) == [["a", "b"]]  # and resuming stretches it
    clock.now = 13.9
    assert book.resume("t", "s", 0.0) == [["a", "b"]]
    clock.now = 14.0
    assert book.resume("t", "s", 100.0) == [] and len(book) == 0


def test_groups_are_replaced_one_namespace_at_a_time():
    book = SessionBook(clock=Clock())
    book.pause("t", "s", "full", ["a"], 10.0)
    book.pause("t", "s", "tail", ["x"], 10.0)
    book.pause("t", "s", "full", ["a", "b"], 10.0)
    assert book.resume("t", "s", 1.0) == [["a", "b"], ["x"]]


def test_owners_are_apart_and_each_book_is_bounded():
    clock = Clock()
    book = SessionBook(max_sessions=2, clock=clock)
    book.pause("alice", "s", "ns", ["a"], 5.0)
    assert book.resume("bob", "s", 1.0) == []
    book.pause("bob", "s", "ns", ["b"], 1.0)
    book.pause("alice", "s2", "ns", ["c"], 50.0)
    book.pause("alice", "s3", "ns", ["d"], 20.0)  # alice's third: her record expiring first goes
    assert book.resume("alice", "s", 1.0) == []
    assert book.resume("alice", "s2", 1.0) == [["c"]] and book.resume("alice", "s3", 1.0) == [["d"]]
    assert book.resume("bob", "s", 1.0) == [["b"]]
    assert book.forget("alice", "s2") and not book.forget("alice", "s2")
    with pytest.raises(ValueError):
        SessionBook(max_sessions=0)


def test_the_lease_rule_and_durations_from_events():
    assert pin_ttl(1.0) == MIN_PIN_S and pin_ttl(100.0) == 400.0 and pin_ttl(1e12) == MAX_PIN_S
    assert [valid_duration(x) for x in (3, "2.5", 0.0)] == [3.0, 2.5, 0.0]
    assert all(valid_duration(x) is None for x in (-1.0, math.nan, math.inf, "soon", None, object()))


def test_one_session_paused_in_ever_new_namespaces_stays_bounded():
    """A record kept one group per namespace a pause named, without limit (max_sessions bounds
    the records, not their size): one tenant with one session id made the daemon hold any
    number of keys. A pause in one namespace more drops the one recorded first."""
    clock = Clock()
    book = SessionBook(max_sessions=1, clock=clock)
    for i in range(1000):  # one session, paused again every second, each time in another namespace
        clock.now = float(i)
        book.pause("alice", "agent-7", f"model-{i}", [f"key-{i}-{j}" for j in range(4)], 60.0)
    groups = book.resume("alice", "agent-7", 60.0)
    assert len(book) == 1
    assert len(groups) == 64, f"one session's record holds {len(groups)} namespaces"
    assert groups[-1] == [f"key-999-{j}" for j in range(4)]  # the latest pause is kept


def test_an_owners_records_hold_at_most_max_keys_the_ones_expiring_first_go():
    """Issue 36, finding 4: records were bounded only by sessions x namespaces x keys per
    request (~1e9 keys per tenant); now by ``max_keys`` per owner."""
    book = SessionBook(clock=Clock(), max_keys=4)
    book.pause("t", "old", "ns", ["a", "b"], 5.0)
    book.pause("t", "new", "ns", ["c", "d"], 50.0)
    book.pause("u", "other", "ns", ["x", "y", "z"], 1.0)  # another owner's book is its own
    book.pause("t", "s", "full", ["e"], 10.0)  # one too many: "old" expires first and goes
    assert book.resume("t", "old", 1.0) == [] and book.resume("t", "new", 1.0) == [["c", "d"]]
    book.pause("t", "s", "tail", ["f", "g", "h"], 100.0)  # then "new"
    assert book.resume("t", "new", 1.0) == [] and book.resume("t", "s", 1.0) == [["e"], ["f", "g", "h"]]
    book.pause("t", "s", "tail", list("ijklmn"), 100.0)  # the last 4, and its own "full" goes
    assert book.resume("t", "s", 1.0) == [list("klmn")]
    assert book.resume("u", "other", 1.0) == [["x", "y", "z"]]
