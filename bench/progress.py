"""Progress of a long benchmark on stderr: how far, how long so far, and an ETA.

A line at most every ``every_s`` seconds (and at the end), so a quick run stays quiet and a
run of minutes says when it will be done.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO


def say(tag: str, message: str) -> None:
    """One line on stderr about what a benchmark does now, after ``[tag]``."""
    print(f"[{tag}] {message}", file=sys.stderr, flush=True)


def _clock(seconds: float) -> str:
    minutes, s = divmod(int(round(seconds)), 60)
    return f"{minutes}m{s:02d}s" if minutes else f"{s}s"


class Progress:
    def __init__(self, total: int, label: str, every_s: float = 5.0, out: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.label, self.every_s = total, label, every_s
        self.out, self.clock = out or sys.stderr, clock
        self.done = 0
        self.start = self._last = clock()

    def step(self, n: int = 1, what: str = "") -> None:
        """``n`` more units done (``what``: a word about the latest, e.g. the policy)."""
        self.done += n
        now = self.clock()
        if now - self._last < self.every_s and self.done < self.total:
            return
        self._last = now
        elapsed = now - self.start
        left = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        detail = f" {what}" if what else ""
        print(f"  {self.label}{detail}: {self.done}/{self.total} ({self.done / self.total:.0%}), "
              f"{_clock(elapsed)} elapsed, ETA {_clock(left)}", file=self.out, flush=True)
