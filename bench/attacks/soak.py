"""A soak: client processes of three tenants mixing every RPC on every path for a while, every
chunk they read checked against what it must hold, while the daemon's memory is sampled.
The daemon's RSS must stay flat and no byte may be wrong. (Run the target with its host
pool prefaulted, or the RSS grows by the pool's pages as they are first touched.)"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

from bench.attacks.processes import worker
from bench.attacks.target import TOKENS, Target, rss_bytes

CHUNKS_PER_WORKER = 64


@dataclass
class SoakReport:
    seconds: float = 0.0
    workers: int = 0
    ops: int = 0
    hits: int = 0
    wrong: int = 0
    errors: int = 0
    rss_samples: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, bytes)
    victim_bad: int = 0

    def as_dict(self) -> dict:
        rss = [r for _, r in self.rss_samples]
        warm = [r for t, r in self.rss_samples if t >= min(60.0, self.seconds / 4)] or rss
        minutes: dict[int, int] = {}
        for t, r in self.rss_samples:
            minutes.setdefault(int(t // 60), r)
        return {"seconds": self.seconds, "workers": self.workers, "ops": self.ops, "hits": self.hits,
                "wrong": self.wrong, "errors": self.errors, "rss_start": rss[0] if rss else 0,
                "rss_after_warmup": warm[0] if warm else 0, "rss_end": rss[-1] if rss else 0,
                "rss_max": max(rss, default=0), "rss_by_minute": list(minutes.values()),
                "victim_bad": self.victim_bad}


def run(target: Target, seconds: float, workers: int = 6, sample_s: float = 1.0) -> SoakReport:
    report = SoakReport(seconds=seconds, workers=workers)
    tenants = ["victim", "attacker", "writer"]
    transports = ["shm", "remote", "grpc"]
    procs = [worker("soak", target.addr, TOKENS[tenants[i % 3]], transports[(i // 3) % 3],
                    1000 + i * CHUNKS_PER_WORKER * 2, CHUNKS_PER_WORKER, seconds) for i in range(workers)]
    stop = threading.Event()
    start = time.monotonic()

    def sample() -> None:
        while not stop.wait(sample_s):
            report.rss_samples.append((time.monotonic() - start, rss_bytes(target.pid)))

    report.rss_samples.append((0.0, rss_bytes(target.pid)))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=seconds + 300)
            tally = next((json.loads(line[6:]) for line in out.splitlines() if line.startswith("TALLY ")), None)
            if tally is None:
                raise RuntimeError(f"a soak worker failed: {err[-2000:]}")
            for name in ("ops", "hits", "wrong", "errors"):
                setattr(report, name, getattr(report, name) + tally[name])
    finally:
        stop.set()
        sampler.join()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    report.rss_samples.append((time.monotonic() - start, rss_bytes(target.pid)))
    report.victim_bad = target.intact()
    return report
