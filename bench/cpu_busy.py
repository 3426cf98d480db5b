"""How busy the machine's cores were during a measured window, and how much of that was
the benchmark's own processes. A benchmark whose emulated devices should be the bottleneck
measures the CPU instead once the cores are saturated; this lets it say so rather than
print a figure that depends on it. Linux only (``/proc``); elsewhere it measures nothing.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
SATURATED = 0.9  # of all cores busy: beyond this a run measures the CPU, not its devices


@dataclass(frozen=True)
class CpuSample:
    at: float  # time.time()
    busy_s: float  # core-seconds the whole machine spent busy since boot
    total_s: float  # core-seconds since boot, busy or idle
    ours_s: float  # core-seconds of this process and its children


@dataclass(frozen=True)
class CpuUse:
    cores: int
    machine: float  # fraction of all cores busy over the window
    ours: float  # fraction of all cores used by this process and its children

    @property
    def saturated(self) -> bool:
        return self.machine >= SATURATED

    def as_dict(self) -> dict:
        return {"cores": self.cores, "machine_busy": round(self.machine, 3), "ours": round(self.ours, 3),
                "others": round(max(0.0, self.machine - self.ours), 3), "saturated": self.saturated}


def _machine() -> tuple[float, float]:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return (total - idle) / TICKS, total / TICKS


def _process_ticks(stat: str) -> tuple[int, int, int]:
    """(parent pid, its own utime + stime, its reaped children's) from a /proc/<pid>/stat
    line (the name may hold spaces and parentheses)."""
    rest = stat[stat.rindex(")") + 2:].split()
    return int(rest[1]), int(rest[11]) + int(rest[12]), int(rest[13]) + int(rest[14])


def _children() -> set[int]:
    """This process's live children, as the kernel lists them per thread (no scan of /proc)."""
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            pids.update(int(pid) for pid in (task / "children").read_text().split())
        except OSError:
            continue  # the thread ended meanwhile
    return pids


def _ours() -> float:
    """This process, its live children, and the children it has reaped (so a child that ends
    inside a window still counts)."""
    _, used, reaped = _process_ticks(Path("/proc/self/stat").read_text())
    ticks = used + reaped
    for pid in _children():
        try:
            ticks += _process_ticks(Path(f"/proc/{pid}/stat").read_text())[1]
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile: its ticks are in ``reaped`` once it is waited for
    return ticks / TICKS


def sample() -> CpuSample | None:
    try:
        busy, total = _machine()
        return CpuSample(time.time(), busy, total, _ours())
    except (OSError, ValueError, IndexError):
        return None


def use_between(first: CpuSample, last: CpuSample) -> CpuUse:
    cores = os.cpu_count() or 1
    total = last.total_s - first.total_s
    wall = last.at - first.at
    if total <= 0 or wall <= 0:
        return CpuUse(cores, 0.0, 0.0)
    return CpuUse(cores, (last.busy_s - first.busy_s) / total,
                  min(1.0, max(0.0, (last.ours_s - first.ours_s) / (wall * cores))))


class CpuMeter:
    """Samples the CPU every ``period_s`` in a thread; ``use(t0, t1)`` is the use over the
    samples that bracket the window [t0, t1] (``time.time()`` values). The kernel counts in
    ticks (10 ms): over a window much shorter than a second the figures are coarse."""

    def __init__(self, period_s: float = 0.05) -> None:
        self._period_s = period_s
        self._samples: list[CpuSample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)

    def __enter__(self) -> "CpuMeter":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            s = sample()
            if s is not None:
                with self._lock:
                    self._samples.append(s)
            if self._stop.wait(self._period_s):
                return

    def use(self, t0: float, t1: float) -> CpuUse | None:
        """None where no sample precedes ``t0`` (the meter started later) or /proc is absent."""
        with self._lock:
            before = [s for s in self._samples if s.at <= t0]
            after = [s for s in self._samples if s.at >= t1]
        last = after[0] if after else sample()
        if not before or last is None or last.at < t1:
            return None
        return use_between(before[-1], last)
