"""Faults injected into cluster members' ledgers and tiers (a reply lost, a commit or a
recount that fails, a member held at a gate after a delete or a write) and the cluster
timings that make heartbeats quick, for the tests of kvstore/cluster/. Real Redis."""

import threading
import time

import redis.exceptions as rex

from faults import FaultyTier
from tiers.base import TierUnavailable
from tiers.wrapped import WrappedTier


def lose_reply_once(ledger, script: str, meanwhile=lambda: None, unreachable_after=False):
    """The next run of ``script`` on ``ledger``'s client runs on the server, then its reply
    is lost (a timeout reading it); ``meanwhile`` runs before the client sees the loss. With
    ``unreachable_after``, redis-py's retry of it times out too, without reaching the server
    (Redis went away right after running it)."""
    client = ledger._client
    sha = ledger._scripts[script].sha
    real = client._send_command_parse_response
    armed = [True]
    retry = [unreachable_after]

    def send(conn, command_name, *args, **options):
        if not armed[0] and retry[0] and command_name == "EVALSHA" and args[1] == sha:
            retry[0] = False
            raise rex.TimeoutError("Timeout connecting to server (injected)")
        result = real(conn, command_name, *args, **options)
        if armed[0] and command_name == "EVALSHA" and args[1] == sha:
            armed[0] = False
            meanwhile()
            raise rex.TimeoutError("Timeout reading from socket (injected: the script ran)")
        return result

    client._send_command_parse_response = send
    return armed


def quick_reaping(cfg):
    """Heartbeats every 0.1 s; a member silent for 0.5 s is reaped."""
    cfg.cluster.heartbeat_s = 0.1
    cfg.cluster.member_ttl_s = 0.5
    return cfg


def quick_retrying(cfg):
    """Heartbeats every 0.1 s (each finishes unfinished deletes); a member silent for 1 s is
    reaped; a reservation busy for 1 s fails."""
    cfg.cluster.heartbeat_s = 0.1
    cfg.cluster.member_ttl_s = 1.0
    cfg.cluster.busy_wait_s = 1.0
    return cfg


def settled(store, timeout_s=5.0) -> bool:
    """Whether the member's unfinished deletes are done within ``timeout_s`` (many heartbeats)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if store.cluster.ledger.state(10.0).tiers["redis"].in_flight == 0:
            return True
        time.sleep(0.05)
    return False


class CommitFailsOnce:
    """A member's ledger whose next commit fails without reaching Redis."""

    def __init__(self, ledger):
        self._ledger, self.failed = ledger, False

    def __getattr__(self, name):
        return getattr(self._ledger, name)

    def commit(self, member, tier, key_id):
        if not self.failed:
            self.failed = True
            raise TierUnavailable("cluster ledger: commit: Redis unreachable (injected)")
        return self._ledger.commit(member, tier, key_id)


def failing_re_put(store):
    """Arms ``store``'s Redis tier so that the copy of its next re-put fails before it lands."""
    tier = store.tier("redis")
    faulty = tier.inner = FaultyTier(tier.inner)
    faulty.failures["write"] = 1
    return tier


class RecountFails:
    """A member's ledger on which the undo of a failed write goes wrong once, ``how``:
    'unreachable' (the recount's reserve fails before it reaches Redis), 'reply lost' (it
    runs; its reply and redis-py's retry are lost) or 'release fails' (the undo's release of
    the write's own reservation fails before it reaches Redis: the recount waits for it)."""

    def __init__(self, ledger, how):
        self._ledger, self.how = ledger, how
        self.released, self.failed = False, False

    def __getattr__(self, name):
        return getattr(self._ledger, name)

    def release(self, member, tier, key_ids, own_only=False):
        if own_only and not self.released:
            self.released = True
            if self.how == "release fails":
                self.failed = True
                raise TierUnavailable("cluster ledger: release: Redis unreachable (injected)")
            if self.how == "reply lost":
                self.failed = True
                lose_reply_once(self._ledger, "reserve", unreachable_after=True)
        return self._ledger.release(member, tier, key_ids, own_only)

    def reserve(self, *args, **kwargs):
        if self.how == "unreachable" and self.released and not self.failed:
            self.failed = True
            raise TierUnavailable("cluster ledger: reserve: Redis unreachable (injected)")
        return self._ledger.reserve(*args, **kwargs)


def failed_recount(a, key, value, how):
    """a's durable raw put, then a re-put (int8) whose copy fails; its recount goes wrong ``how``."""
    a.put(key, value, durable=True)  # the older value: raw, on Redis
    tier = failing_re_put(a)
    tier.ledger = failing = RecountFails(tier.ledger, how)
    a.put(key, value, codec="int8")
    assert a.flush(30) and failing.failed
    return tier


class HeldAfterDelete(WrappedTier):
    """Deletes, then holds the caller at ``gate`` (the value is gone, the caller goes on later)."""

    def __init__(self, inner, gate):
        super().__init__(inner)
        self.gate = gate

    def delete(self, key):
        gone = self.inner.delete(key)
        self.gate.pass_through(key)
        return gone


class HeldBeforeDelete(WrappedTier):
    """Holds the caller at ``gate``, then deletes (the ledger entry is taken, the value not gone yet)."""

    def __init__(self, inner, gate):
        super().__init__(inner)
        self.gate = gate

    def delete(self, key):
        self.gate.pass_through(key)
        return self.inner.delete(key)


class HeldAfterWrite(WrappedTier):
    """Writes, then holds the caller at ``gate`` (the value is in place, not committed yet)."""

    def __init__(self, inner, gate):
        super().__init__(inner)
        self.gate = gate

    def write(self, key, parts):
        self.inner.write(key, parts)
        self.gate.pass_through(key)


class WatchedLedger:
    """A member's ledger that notes a "busy" answer to a reservation, and holds a member at
    ``after_evicted`` once the ledger was told its value is gone."""

    def __init__(self, ledger, after_evicted=None):
        self._ledger, self.after_evicted = ledger, after_evicted
        self.busy = threading.Event()

    def __getattr__(self, name):
        return getattr(self._ledger, name)

    def reserve(self, *args, **kwargs):
        answer = self._ledger.reserve(*args, **kwargs)
        if answer[0] == "busy":
            self.busy.set()
        return answer

    def evicted(self, member, tier, key_ids):
        used = self._ledger.evicted(member, tier, key_ids)
        if self.after_evicted is not None:
            for key_id in key_ids:
                self.after_evicted.pass_through(key_id)
        return used


def watch_ledger(store, after_evicted=None) -> WatchedLedger:
    budgeted = store.tier("redis")
    budgeted.ledger = WatchedLedger(budgeted.ledger, after_evicted)
    return budgeted.ledger
