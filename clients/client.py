"""Python clients of the twinplane Generation service (twinplane.v1, gRPC).

    with Client("localhost:50051") as client:
        client.wait_ready(timeout=60)
        for chunk in client.generate(messages=[("user", "Hi!")], max_tokens=32):
            print(chunk.text, end="")

Requests are built and responses converted by ``twinplane.clients.messages``
(re-exported here, so one import gives the whole client API). ``Client`` is
synchronous; ``AsyncClient`` has the same methods on grpc.aio.

Errors: every method lets ``grpc.RpcError`` (``grpc.aio.AioRpcError`` for the
async client) propagate; its ``code()`` is INVALID_ARGUMENT for bad requests,
UNAUTHENTICATED for a missing or wrong API key, UNAVAILABLE when the server
cannot be reached. ``build_request`` raises ValueError for unusable arguments.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from twinplane.clients.messages import (  # re-exported: the client's whole API in one import
    FINISH_REASONS,
    ChannelOptions,
    GenerateChunk,
    Message,
    ModelInfo,
    PositionLogprobs,
    Usage,
    build_request,
    build_tokenize_request,
    chat_input,
    chunk_from_pb,
    model_info_from_pb,
    stats_from_pb,
)
from twinplane.proto import generation_pb2 as pb
from twinplane.proto import generation_pb2_grpc as pb_grpc

__all__ = [
    "AsyncClient", "AsyncGenerateStream", "Client", "GenerateStream", "open_channel",
    # from twinplane.clients.messages
    "FINISH_REASONS", "ChannelOptions", "GenerateChunk", "Message", "ModelInfo", "PositionLogprobs", "Usage",
    "build_request", "build_tokenize_request", "chat_input", "chunk_from_pb", "model_info_from_pb",
    "stats_from_pb",
]

READY_POLL_S = 0.2  # pause between health checks in wait_ready
MAX_WAIT_S = 86_400.0  # the longest timeout a command takes: gRPC deadlines overflow not far past it
HEALTH_REQUEST = health_pb2.HealthCheckRequest(service="")  # "" = the server as a whole


# ---- channels -----------------------------------------------------------------------------


# gRPC's own default is 4 MiB; a long prompt's log-probabilities with their top tokens come to more
# (~210 bytes a token with the top 20), in one message. The server sends at most 16 MiB by default.
MAX_RECEIVE_BYTES = 64 << 20


def open_channel(
    api: Any, target: str, root_certificates: bytes | None, tls: bool | None, options: ChannelOptions
) -> Any:
    """A channel from api (grpc or grpc.aio): TLS when tls, or by default iff root certificates are given;
    messages of up to MAX_RECEIVE_BYTES unless options say otherwise."""
    if tls is None:
        tls = root_certificates is not None
    options = list(options)
    if not any(name == "grpc.max_receive_message_length" for name, _ in options):
        options.append(("grpc.max_receive_message_length", MAX_RECEIVE_BYTES))
    if not tls:
        return api.insecure_channel(target, options=options)
    return api.secure_channel(target, grpc.ssl_channel_credentials(root_certificates), options=options)


def _auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def _deadline_left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _not_ready(status: str) -> TimeoutError:
    return TimeoutError(f"server not ready before the timeout (last health status: {status})")


def _is_transient(error: grpc.RpcError) -> bool:
    """Whether a failed health check may succeed later (server starting, or busy)."""
    return error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


# ---- synchronous client -------------------------------------------------------------------


class GenerateStream:
    """A running Generate call: iterate it (once) for GenerateChunks.

    ``cancel()`` aborts the request on the server; iteration then ends quietly.
    Used as a context manager, the call is cancelled on exit. ``final`` is the
    last chunk (with finish_reason and usage) once the stream has ended.
    """

    def __init__(self, call: Any) -> None:
        self._call = call  # grpc's response iterator, also a grpc.Call
        self._cancelled = False
        self.final: GenerateChunk | None = None

    def __iter__(self) -> Iterator[GenerateChunk]:
        try:
            for response in self._call:
                chunk = chunk_from_pb(response)
                if chunk.finish_reason is not None:
                    self.final = chunk
                yield chunk
        except grpc.RpcError as error:
            if not (self._cancelled and error.code() == grpc.StatusCode.CANCELLED):
                raise

    def cancel(self) -> None:
        """Aborts the request; the server frees its KV cache at once."""
        self._cancelled = True
        self._call.cancel()

    def text(self) -> str:
        """Consumes the stream and returns all of its text."""
        return "".join(chunk.text for chunk in self)

    def __enter__(self) -> GenerateStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cancel()


class Client:
    """Synchronous client. Methods raise grpc.RpcError when a call fails.

    Plaintext unless root_certificates are given or tls=True (system roots); an
    api_key is sent with every call as ``authorization: Bearer <key>``.
    """

    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        root_certificates: bytes | None = None,
        tls: bool | None = None,
        options: ChannelOptions = (),
    ) -> None:
        self._channel = open_channel(grpc, target, root_certificates, tls, options)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = _auth_metadata(api_key)

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any) -> GenerateStream:
        """Starts a generation; kwargs are those of build_request."""
        request = build_request(prompt, **kwargs)
        return GenerateStream(self._stub.Generate(request, timeout=timeout, metadata=self._metadata))

    def generate_text(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any) -> str:
        """Generates and returns the whole completion text."""
        return self.generate(prompt, timeout=timeout, **kwargs).text()

    def tokenize(
        self, text: str | None = None, messages: Iterable[Message] | None = None, *, timeout: float | None = None,
        **chat: Any
    ) -> list[int]:
        """Token ids of text, or of chat messages rendered with the chat template (chat: chat_input's options)."""
        request = build_tokenize_request(text, messages, **chat)
        return list(self._stub.Tokenize(request, timeout=timeout, metadata=self._metadata).token_ids)

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """The served model and its limits."""
        reply = self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self._metadata)
        return model_info_from_pb(reply)

    def stats(self, *, timeout: float | None = None) -> dict[str, int]:
        """The engine's counters since start-up (ServerStats fields)."""
        reply = self._stub.GetStats(pb.GetStatsRequest(), timeout=timeout, metadata=self._metadata)
        return stats_from_pb(reply)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Polls grpc.health.v1 Check until SERVING; TimeoutError after timeout seconds."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.health_status(_deadline_left(deadline))
            if status == "SERVING":
                return
            if _deadline_left(deadline) <= 0:
                raise _not_ready(status)
            time.sleep(min(READY_POLL_S, _deadline_left(deadline)))

    def health_check(self, timeout: float) -> str:
        """One grpc.health.v1 Check: the serving status (SERVING, NOT_SERVING, ...); a failed call raises."""
        reply = self._health.Check(HEALTH_REQUEST, timeout=max(timeout, 0.01), metadata=self._metadata)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def health_status(self, timeout: float) -> str:
        """health_check's status, or the code name of a failure that may pass later (UNAVAILABLE,
        DEADLINE_EXCEEDED); other failures raise."""
        try:
            return self.health_check(timeout)
        except grpc.RpcError as error:
            if not _is_transient(error):
                raise
            return error.code().name

    def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ---- asyncio client -----------------------------------------------------------------------


class AsyncGenerateStream:
    """A running Generate call on grpc.aio: ``async for`` it (once) for GenerateChunks.

    ``cancel()`` aborts the request on the server; iteration then ends quietly.
    """

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call
        self._cancelled = False
        self.final: GenerateChunk | None = None

    def __aiter__(self) -> AsyncIterator[GenerateChunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[GenerateChunk]:
        try:
            async for response in self._call:
                chunk = chunk_from_pb(response)
                if chunk.finish_reason is not None:
                    self.final = chunk
                yield chunk
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as error:
            if not self._was_cancelled(error):
                raise

    def _was_cancelled(self, error: BaseException) -> bool:
        if not self._cancelled:
            return False
        return not isinstance(error, grpc.RpcError) or error.code() == grpc.StatusCode.CANCELLED

    def cancel(self) -> None:
        """Aborts the request; the server frees its KV cache at once."""
        self._cancelled = True
        self._call.cancel()

    async def text(self) -> str:
        """Consumes the stream and returns all of its text."""
        return "".join([chunk.text async for chunk in self])


class AsyncClient:
    """asyncio client with Client's methods (coroutines, except generate).

    Methods raise grpc.aio.AioRpcError (a grpc.RpcError) when a call fails.
    Create it inside the event loop that uses it.
    """

    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        root_certificates: bytes | None = None,
        tls: bool | None = None,
        options: ChannelOptions = (),
    ) -> None:
        self._channel = open_channel(grpc.aio, target, root_certificates, tls, options)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = _auth_metadata(api_key)

    def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any
    ) -> AsyncGenerateStream:
        """Starts a generation (no await needed); kwargs are those of build_request."""
        request = build_request(prompt, **kwargs)
        return AsyncGenerateStream(self._stub.Generate(request, timeout=timeout, metadata=self._metadata))

    async def generate_text(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any) -> str:
        """Generates and returns the whole completion text."""
        return await self.generate(prompt, timeout=timeout, **kwargs).text()

    async def tokenize(
        self, text: str | None = None, messages: Iterable[Message] | None = None, *, timeout: float | None = None,
        **chat: Any
    ) -> list[int]:
        """Token ids of text, or of chat messages rendered with the chat template (chat: chat_input's options)."""
        request = build_tokenize_request(text, messages, **chat)
        reply = await self._stub.Tokenize(request, timeout=timeout, metadata=self._metadata)
        return list(reply.token_ids)

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """The served model and its limits."""
        reply = await self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self._metadata)
        return model_info_from_pb(reply)

    async def stats(self, *, timeout: float | None = None) -> dict[str, int]:
        """The engine's counters since start-up (ServerStats fields)."""
        reply = await self._stub.GetStats(pb.GetStatsRequest(), timeout=timeout, metadata=self._metadata)
        return stats_from_pb(reply)

    async def wait_ready(self, timeout: float = 30.0) -> None:
        """Polls grpc.health.v1 Check until SERVING; TimeoutError after timeout seconds."""
        deadline = time.monotonic() + timeout
        while True:
            status = await self.health_status(_deadline_left(deadline))
            if status == "SERVING":
                return
            if _deadline_left(deadline) <= 0:
                raise _not_ready(status)
            await asyncio.sleep(min(READY_POLL_S, _deadline_left(deadline)))

    async def health_check(self, timeout: float) -> str:
        """One grpc.health.v1 Check: the serving status (SERVING, NOT_SERVING, ...); a failed call raises."""
        reply = await self._health.Check(HEALTH_REQUEST, timeout=max(timeout, 0.01), metadata=self._metadata)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def health_status(self, timeout: float) -> str:
        """health_check's status, or the code name of a failure that may pass later (UNAVAILABLE,
        DEADLINE_EXCEEDED); other failures raise."""
        try:
            return await self.health_check(timeout)
        except grpc.aio.AioRpcError as error:
            if not _is_transient(error):
                raise
            return error.code().name

    async def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
