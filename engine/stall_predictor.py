"""How long will this agent stall? A prediction from past stalls, for pauses that came
without an expected duration (or none at all).

Per tool and per session, an exponentially weighted mean of the stalls seen (the time from
a turn's end to the session's next request). A prediction uses the tool's estimate and the
session's, averaged when both exist (TokenCake's rule for an estimate and a history), else
whichever exists, else the default. Stalls are heavy-tailed: one long stall raises the
estimate for a few turns, which errs on the side of freeing the device.
"""

from __future__ import annotations

import math


class StallPredictor:
    def __init__(self, default_s: float, alpha: float) -> None:
        self.default_s, self.alpha = default_s, alpha
        self._by_tool: dict[str, float] = {}
        self._by_session: dict[str, float] = {}

    def _update(self, table: dict[str, float], name: str, seconds: float) -> None:
        old = table.get(name)
        table[name] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds

    def observe(self, seconds: float, tool: str = "", session: str = "") -> None:
        """A stall of ``seconds`` that ended; ignored unless finite and not negative."""
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        if tool:
            self._update(self._by_tool, tool, seconds)
        if session:
            self._update(self._by_session, session, seconds)

    def predict(self, tool: str = "", session: str = "") -> float:
        known = [t[n] for t, n in ((self._by_tool, tool), (self._by_session, session)) if n and n in t]
        return sum(known) / len(known) if known else self.default_s

    def forget(self, session: str) -> None:
        self._by_session.pop(session, None)
