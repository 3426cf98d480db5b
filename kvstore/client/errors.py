"""What a failed call raises, and which failures are worth another try."""

from __future__ import annotations

import grpc

_STATUS = {code.value[0]: code for code in grpc.StatusCode}


class DaemonError(Exception):
    """An RPC failed; ``code`` is the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @property
    def pushback(self) -> bool:
        """The daemon is full or busy now (kvstore.api.pushed_back), not gone."""
        return self.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def status(number: int) -> grpc.StatusCode:
    return _STATUS.get(number, grpc.StatusCode.UNKNOWN)


RENEW, RETRY, RAISE = "renew", "retry", "raise"


def stale(exc: DaemonError) -> bool:
    """A lease or bulk session the daemon no longer knows (lapsed, or it restarted)."""
    return exc.code == grpc.StatusCode.FAILED_PRECONDITION and ("lease" in exc.message or "bulk session" in exc.message)


def decide(exc: BaseException, attempt: int, renewed: bool, retries: int) -> str:
    """What to do after attempt number ``attempt`` (from 0) of a call failed with ``exc``:
    replace a stale lease or session once at once (RENEW), try again after a backoff
    (RETRY: the daemon is unreachable or restarting, or a bulk connection broke; every
    operation is idempotent), or give up (RAISE)."""
    if isinstance(exc, DaemonError):
        if stale(exc) and not renewed:
            return RENEW
        return RETRY if exc.code == grpc.StatusCode.UNAVAILABLE and attempt < retries else RAISE
    if isinstance(exc, OSError):  # ConnectionError, socket timeouts: the bulk channel broke
        return RETRY if attempt < retries else RAISE
    return RAISE


def slots_reusable(exc: BaseException) -> bool:
    """Whether a request that failed with ``exc`` left its slots untouched by the daemon: it
    answered with a status, and it answers only once it has stopped using them. A timeout,
    a cancellation or a broken connection says nothing of the kind."""
    return isinstance(exc, DaemonError) and exc.code not in (
        grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
