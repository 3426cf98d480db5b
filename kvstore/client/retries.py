"""How a client's call is tried again: only UNAVAILABLE and a broken bulk connection, with
exponential backoff (every operation is idempotent); a lease or bulk session the daemon no
longer knows is replaced once, at once. Which failures count is kvstore/client/errors.py's
``decide``; between attempts the transports start afresh."""

from __future__ import annotations

import grpc

from kvstore.client.effects import Rpc, Sleep
from kvstore.client.errors import RAISE, RENEW, DaemonError, decide
from kvstore.client.options import ClientOptions
from kvstore.client.transports import Transports


class Retrier:
    def __init__(self, options: ClientOptions, transports: Transports) -> None:
        self.options, self.transports = options, transports

    def run(self, attempt_once):
        """Run ``attempt_once()`` (a generator) until it succeeds or ``decide`` gives up,
        resetting the transports between attempts."""
        delay, renewed, attempt = self.options.backoff_s, False, 0
        while True:
            try:
                return (yield from attempt_once())
            except (DaemonError, OSError) as exc:
                decision = decide(exc, attempt, renewed, self.options.retries)
                if decision == RAISE:
                    if isinstance(exc, OSError):
                        raise DaemonError(grpc.StatusCode.UNAVAILABLE, f"bulk channel: {exc}") from None
                    raise
            yield from self.transports.drop()
            if decision == RENEW:
                renewed = True
                continue
            yield Sleep(delay)
            delay *= 2
            attempt += 1

    def rpc(self, method: str, request, health: bool = False):
        """A unary call of ``method`` (of the health service with ``health``), retried."""
        def once():
            return (yield Rpc(method, request, health))

        return (yield from self.run(once))
