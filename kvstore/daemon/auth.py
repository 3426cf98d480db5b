"""Bearer-token authentication for every RPC (health and reflection included).

The token travels as ``authorization: Bearer <token>`` metadata; a call without it, or with
another token, ends UNAUTHENTICATED before its handler runs. Tokens are compared in
constant time.
"""

from __future__ import annotations

import hmac
import grpc

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
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def check(self, value: str | bytes | None) -> bool:
        if value is None:
            return False
        got = value.encode() if isinstance(value, str) else value
        return hmac.compare_digest(got, self._expected)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if handler is None or self.check(metadata.get(METADATA_KEY)):
            return handler
        return _deny(handler)
