"""Clients that die mid-Get, mid-Put and while holding pins: real client processes, SIGKILLed
at a random moment of their work. After each death the daemon must give everything back
(leases within their TTL, bulk sessions and pinned host pages at once), keep serving, and
have lost none of the victim's chunks."""

from __future__ import annotations

import random
import signal
import time
from dataclasses import dataclass, field

from bench.attacks.processes import wait_for_line, worker
from bench.attacks.worker import PUT_KEYS
from bench.attacks.target import TOKENS, Target, keys


@dataclass
class DyingReport:
    kills: dict[str, int] = field(default_factory=dict)
    recovery_s: list[float] = field(default_factory=list)  # until slots, sessions and pages were back
    wrong: int = 0  # wrong bytes the workers read before they died
    victim_bad: int = 0

    def as_dict(self) -> dict:
        return {"kills": self.kills, "max_recovery_s": max(self.recovery_s, default=0.0),
                "wrong": self.wrong, "victim_bad": self.victim_bad}


def _quiet(target: Target, slots: int, host_bytes: int, forget, timeout_s: float = 30.0) -> float:
    """Seconds until every slot is free, no bulk session is open and host RAM holds no more
    than ``host_bytes`` (no pages pinned for a dead client), calling ``forget()`` (which
    deletes what the dead client stored: a Put it had in flight may land after its death)
    each time."""
    start = time.monotonic()
    with target.client("victim", transport="grpc") as observer:
        while True:
            forget()
            reply = observer.stats_reply()
            host = next(t for t in reply.tiers if t.name == "host")
            if reply.shm_slots_free == slots and reply.bulk_sessions == 0 and host.used_bytes <= host_bytes:
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise RuntimeError(f"the daemon did not recover from a dead client: {reply}")
            time.sleep(0.05)


CASES = (("get", "shm"), ("get", "remote"), ("get", "grpc"), ("put", "shm"), ("put", "remote"), ("pin", "shm"),
         ("pin", "remote"))


def run(target: Target, rounds: int, seed: int = 0, slots: int = 64, cases=CASES) -> DyingReport:
    """``rounds`` deaths of each kind of ``cases`` (Get, Put, holding pins; on a transport)."""
    rng = random.Random(seed)
    report = DyingReport()
    n = len(target.victim_keys)
    with target.client("victim", transport="grpc") as c:
        host_bytes = next(t for t in c.stats_reply().tiers if t.name == "host").used_bytes
    for r in range(rounds):
        for mode, transport in cases:
            tenant = "victim" if mode == "get" else "attacker"
            start = 0 if mode == "get" else 10_000 + 1000 * r
            proc = worker(mode, target.addr, TOKENS[tenant], transport, start, n if mode == "get" else 16)
            try:
                wait_for_line(proc, "held" if mode == "pin" else ("got" if mode == "get" else "put"))
                time.sleep(rng.uniform(0, 0.2))  # somewhere in the middle of an operation
            finally:
                proc.send_signal(signal.SIGKILL)
                out, _ = proc.communicate()
            report.wrong += out.count("WRONG")
            report.kills[f"{mode}/{transport}"] = report.kills.get(f"{mode}/{transport}", 0) + 1
            with target.client("attacker", transport="grpc") as attacker:
                stored = keys(start, PUT_KEYS) if mode != "get" else []

                def forget() -> None:  # what the dead one stored: its pages go, unless still pinned
                    for first in range(0, len(stored), 1024):
                        attacker.delete(stored[first : first + 1024])

                report.recovery_s.append(_quiet(target, slots, host_bytes, forget))
    report.victim_bad = target.intact()
    return report
