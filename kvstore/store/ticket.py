"""A durable put's wait for its copies written behind: done when each is written and synced,
or failed with its tier's error. Nobody else's put can clear it (review #3).
"""

from __future__ import annotations

import threading


class Ticket:
    """One durable put's wait for its copies."""

    def __init__(self) -> None:
        self.waiting = 0
        self.errors: list[Exception] = []
        self.done = threading.Event()
        self.done.set()

    def expect(self) -> None:
        self.waiting += 1
        self.done.clear()

    def finish(self, error: Exception | None) -> None:
        if error is not None:
            self.errors.append(error)
        self.waiting -= 1
        if self.waiting == 0:
            self.done.set()

    def fail(self, error: Exception) -> None:
        self.errors.append(error)

    def wait(self, timeout_s: float) -> None:
        """Return once every copy is done; raise the first copy's error, or TimeoutError."""
        if not self.done.wait(timeout_s):
            raise TimeoutError(f"durable put: copies not done within {timeout_s:g} s (they go on in the background)")
        if self.errors:
            raise self.errors[0]
