"""Optional API key, checked for every call by one server interceptor."""

from __future__ import annotations

import hmac

import grpc

# Health checks stay open so that load balancers and orchestrators can probe; Watch, a stream each
# caller holds open, does not.
OPEN_METHODS = ("/grpc.health.v1.Health/Check",)
MESSAGE = "missing or wrong API key: send metadata 'authorization: Bearer <key>'"


async def _deny_unary(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)


async def _deny_stream(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)
    yield  # pragma: no cover  (makes this an async generator)


_DENY = {  # (request_streaming, response_streaming) -> handler
    (False, False): grpc.unary_unary_rpc_method_handler(_deny_unary),
    (False, True): grpc.unary_stream_rpc_method_handler(_deny_stream),
    (True, False): grpc.stream_unary_rpc_method_handler(_deny_unary),
    (True, True): grpc.stream_stream_rpc_method_handler(_deny_stream),
}


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str):
        self._expected = f"Bearer {api_key}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHODS):
            return handler
        sent = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(sent.encode(), self._expected):  # constant-time comparison
            return handler
        return _DENY[(handler.request_streaming, handler.response_streaming)]
