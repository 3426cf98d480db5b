"""The daemon's one error and metrics boundary: what a request may end with, and where that is
counted.

Only the project's own errors become statuses with their message: ``Fail`` (validation,
limits, permissions), slot and bulk-session errors, a blob the client sent that failed
verification, a full tier, a Store shutting down. A tier's I/O error is INTERNAL with its
message. Anything else is a bug: logged with its traceback and answered INTERNAL, never
blamed on the caller as INVALID_ARGUMENT. Every handler, unary or streaming, gRPC or bulk
channel, runs inside one ``RpcBoundary.scope``.

Parsers never raise (``safe_parser``): grpc's own answer to a deserializer error is a vague
UNKNOWN, so a message that does not parse reaches the boundary as ``Malformed`` and ends
INVALID_ARGUMENT.
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from typing import Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from kvstore.blob import CorruptBlob
from kvstore.daemon.bulk import BulkError
from kvstore.daemon.metrics import DaemonMetrics
from kvstore.daemon.slots import SlotError
from kvstore.store import StoreClosed
from tiers.base import TierError, TierFull

log = logging.getLogger("kvstore.daemon")

SLOT_STATUS = {
    "stale": grpc.StatusCode.FAILED_PRECONDITION,
    "forged": grpc.StatusCode.PERMISSION_DENIED,
    "range": grpc.StatusCode.OUT_OF_RANGE,
    "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "busy": grpc.StatusCode.ABORTED,
    "abandoned": grpc.StatusCode.CANCELLED,
}


class Fail(Exception):
    """End the request with ``code`` and this message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Malformed:
    """Stands in for a message that did not parse."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def safe_parser(cls):
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError) as exc:
            return Malformed(exc)

    return parse


def parsed(message):
    """``message``, or Fail INVALID_ARGUMENT if it did not parse."""
    if isinstance(message, Malformed):
        raise Fail(grpc.StatusCode.INVALID_ARGUMENT, f"malformed or truncated message: {message.error}")
    return message


def translate(exc: Exception, name: str) -> Fail:
    """The status ``exc`` ends request ``name`` with; bugs are logged here."""
    if isinstance(exc, Fail):
        return exc
    if isinstance(exc, SlotError):
        return Fail(SLOT_STATUS[exc.kind], str(exc))
    if isinstance(exc, BulkError):  # too many sessions
        return Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    if isinstance(exc, CorruptBlob):
        return Fail(grpc.StatusCode.INVALID_ARGUMENT, f"blob rejected: {type(exc).__name__}: {exc}")
    if isinstance(exc, TierFull):
        return Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    if isinstance(exc, StoreClosed):
        return Fail(grpc.StatusCode.UNAVAILABLE, "the daemon is shutting down")
    if isinstance(exc, TierError):
        log.warning("%s: %s: %s", name, type(exc).__name__, exc)
        return Fail(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
    log.error("%s: internal error", name, exc_info=exc)
    return Fail(grpc.StatusCode.INTERNAL, f"internal error in {name} ({type(exc).__name__}); the daemon logged it")


class RpcBoundary:
    """Latency and error metrics of every request, and its translation into a status."""

    def __init__(self, metrics: DaemonMetrics) -> None:
        self.metrics = metrics

    @asynccontextmanager
    async def scope(self, name: str, answer: Callable[[Fail], Awaitable[None]],
                    passthrough: tuple[type[BaseException], ...] = ()):
        """Run a request named ``name``; an error is counted and ``answer``ed (which may
        raise, as grpc's abort does). ``passthrough`` errors propagate untouched."""
        start = time.perf_counter()
        try:
            yield
        except passthrough:
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            fail = translate(exc, name)
            self.metrics.rpc_errors.labels(name, fail.code.name).inc()
            await answer(fail)
        finally:
            self.metrics.rpc_seconds.labels(name).observe(time.perf_counter() - start)
