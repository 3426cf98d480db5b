"""Bearer-token authentication for every RPC (health and reflection included).

The token travels as ``authorization: Bearer <token>`` metadata; a call without a token the
daemon knows ends UNAUTHENTICATED before its handler runs. Which tenant a token (or, with
mutual TLS, a client certificate) belongs to is ``Credentials.identify``'s answer, asked by
the KVStore handlers themselves (kvstore/daemon/service.py).
"""

from __future__ import annotations

import grpc

from kvstore.daemon.identity import Credentials
from kvstore.wire.auth import METADATA_KEY


def _deny(kind: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def unary(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

    async def streaming(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
        yield  # pragma: no cover - makes this an async generator

    if kind.request_streaming and kind.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if kind.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if kind.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming)
    return grpc.unary_unary_rpc_method_handler(unary)


class TokenAuth(grpc.aio.ServerInterceptor):
    def __init__(self, credentials: Credentials) -> None:
        self._credentials = credentials

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if handler is None or self._credentials.token_valid(metadata.get(METADATA_KEY)):
            return handler
        return _deny(handler)
