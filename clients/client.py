"""Python clients of the twinplane Generation service (twinplane.v1, gRPC).

    with Client("localhost:50051") as client:
        client.wait_ready(timeout=60)
        for chunk in client.generate(messages=[("user", "Hi!")], max_tokens=32):
            print(chunk.text, end="")

``build_request`` turns keyword arguments into a GenerateRequest (None leaves a
proto3 optional field unset, so the server's documented default applies), and
``chunk_from_pb`` / ``model_info_from_pb`` turn responses into the plain
dataclasses below: no generated message class leaves this module. ``Client`` is
synchronous; ``AsyncClient`` has the same methods on grpc.aio.

Errors: every method lets ``grpc.RpcError`` (``grpc.aio.AioRpcError`` for the
async client) propagate; its ``code()`` is INVALID_ARGUMENT for bad requests,
UNAUTHENTICATED for a missing or wrong API key, UNAVAILABLE when the server
cannot be reached. ``build_request`` raises ValueError for unusable arguments.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Union

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from twinplane.proto import generation_pb2 as pb
from twinplane.proto import generation_pb2_grpc as pb_grpc

Message = Union[Mapping[str, str], tuple[str, str]]  # {"role", "content"} or (role, content)
ChannelOptions = Sequence[tuple[str, Any]]

FINISH_REASONS: dict[int, str | None] = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP_TOKEN: "stop_token",
    pb.FINISH_REASON_STOP_STRING: "stop_string",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORTED: "aborted",
}
READY_POLL_S = 0.2  # pause between health checks in wait_ready
HEALTH_REQUEST = health_pb2.HealthCheckRequest(service="")  # "" = the server as a whole


@dataclass(frozen=True)
class PositionLogprobs:
    """Log-probabilities at one generated position."""

    token_id: int  # the sampled token
    logprob: float  # its natural-log probability
    top: list[tuple[int, float]]  # (token_id, logprob) of the most likely tokens, best first


@dataclass(frozen=True)
class Usage:
    """Token counts of a finished request."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int  # prompt tokens whose KV cache was reused


@dataclass(frozen=True)
class GenerateChunk:
    """One message of a generation stream: what was generated since the previous one."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[PositionLogprobs]  # one per token id, when requested
    finish_reason: str | None  # a FINISH_REASONS value: None while running ("unknown" if newer than us)
    usage: Usage | None  # on the last chunk only
    matched_stop: str  # the stop string that ended the request, else ""


@dataclass(frozen=True)
class ModelInfo:
    """The served model and the limits that requests must respect."""

    model: str
    architecture: str
    vocab_size: int
    max_model_len: int
    dtype: str
    block_size: int
    num_kv_blocks: int
    tensor_parallel_size: int
    attention_backend: str
    eos_token_ids: list[int]
    max_logprobs: int
    has_chat_template: bool
    weight_bytes: int = 0
    kv_bytes_per_token: int = 0
    device: str = ""


# ---- protobuf edge: requests --------------------------------------------------------------


def build_request(
    prompt: str | None = None,
    *,
    token_ids: Iterable[int] | None = None,
    messages: Iterable[Message] | None = None,
    request_id: str = "",
    max_tokens: int | None = None,
    min_tokens: int = 0,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    seed: int | None = None,
    stop: str | Iterable[str] = (),
    stop_token_ids: Iterable[int] = (),
    ignore_eos: bool = False,
    logprobs: int | None = None,
    truncate_prompt_tokens: int = 0,
    skip_special_tokens: bool | None = None,
) -> pb.GenerateRequest:
    """A GenerateRequest from exactly one of prompt, token_ids and messages.

    None leaves an optional field unset (the server's default applies). Raises
    ValueError unless exactly one input is given or when messages are malformed.
    """
    _check_one_input(prompt=prompt, token_ids=token_ids, messages=messages)
    sampling = pb.SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, seed=seed,
    )
    request = pb.GenerateRequest(
        request_id=request_id, max_tokens=max_tokens, min_tokens=min_tokens,
        stop=[stop] if isinstance(stop, str) else list(stop), stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos, logprobs=logprobs, truncate_prompt_tokens=truncate_prompt_tokens,
        skip_special_tokens=skip_special_tokens,
    )
    if sampling.ListFields():
        request.sampling.CopyFrom(sampling)
    if prompt is not None:
        request.text = prompt
    elif token_ids is not None:
        request.token_ids.ids.extend(_token_ids(token_ids))
    else:
        request.chat.CopyFrom(chat_input(messages or ()))
    return request


def build_tokenize_request(
    text: str | None = None, messages: Iterable[Message] | None = None
) -> pb.TokenizeRequest:
    """A TokenizeRequest from exactly one of text and messages (else ValueError)."""
    _check_one_input(text=text, messages=messages)
    if text is not None:
        return pb.TokenizeRequest(text=text)
    return pb.TokenizeRequest(chat=chat_input(messages or ()))


def chat_input(messages: Iterable[Message]) -> pb.ChatInput:
    """Chat messages, each {"role", "content"} or (role, content), as a ChatInput."""
    chat = pb.ChatInput()
    for message in messages:
        role, content = _role_and_content(message)
        chat.messages.add(role=role, content=content)
    return chat


def _check_one_input(**inputs: object) -> None:
    given = [name for name, value in inputs.items() if value is not None]
    if len(given) != 1:
        names = ", ".join(inputs)
        raise ValueError(f"give exactly one of {names}; got {', '.join(given) or 'none'}")


def _role_and_content(message: Message) -> tuple[str, str]:
    if isinstance(message, Mapping):
        if "role" not in message or "content" not in message:
            raise ValueError(f"a chat message needs 'role' and 'content', got keys {sorted(message)}")
        role, content = message["role"], message["content"]
    elif isinstance(message, tuple) and len(message) == 2:
        role, content = message
    else:
        raise ValueError(f"a chat message is a dict or a (role, content) tuple, got {message!r}")
    if not isinstance(role, str) or not isinstance(content, str):
        raise ValueError(f"chat role and content must be strings, got {message!r}")
    return role, content


def _token_ids(ids: Iterable[int]) -> list[int]:
    result = [int(i) for i in ids]
    if any(i < 0 for i in result):
        raise ValueError("token ids must be >= 0")
    return result


# ---- protobuf edge: responses -------------------------------------------------------------


def chunk_from_pb(response: pb.GenerateResponse) -> GenerateChunk:
    """A GenerateResponse as a GenerateChunk."""
    usage = None
    if response.HasField("usage"):
        u = response.usage
        usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)
    return GenerateChunk(
        request_id=response.request_id,
        token_ids=list(response.token_ids),
        text=response.text,
        logprobs=[_position_logprobs(p) for p in response.logprobs],
        finish_reason=FINISH_REASONS.get(response.finish_reason, "unknown"),
        usage=usage,
        matched_stop=response.matched_stop,
    )


def _position_logprobs(position: pb.PositionLogprobs) -> PositionLogprobs:
    return PositionLogprobs(
        token_id=position.sampled.token_id,
        logprob=position.sampled.logprob,
        top=[(t.token_id, t.logprob) for t in position.top],
    )


def model_info_from_pb(info: pb.ModelInfo) -> ModelInfo:
    """A ModelInfo message as a ModelInfo dataclass (fields of the same names)."""
    values = {f.name: getattr(info, f.name) for f in fields(ModelInfo)}
    return ModelInfo(**{**values, "eos_token_ids": list(info.eos_token_ids)})


# ---- channels -----------------------------------------------------------------------------


def stats_from_pb(stats: pb.ServerStats) -> dict[str, int]:
    return {f.name: getattr(stats, f.name) for f in stats.DESCRIPTOR.fields}


def open_channel(
    api: Any, target: str, root_certificates: bytes | None, tls: bool | None, options: ChannelOptions
) -> Any:
    """A channel from api (grpc or grpc.aio): TLS when tls, or by default iff root certificates are given."""
    if tls is None:
        tls = root_certificates is not None
    if not tls:
        return api.insecure_channel(target, options=list(options))
    return api.secure_channel(target, grpc.ssl_channel_credentials(root_certificates), options=list(options))


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
        self, text: str | None = None, messages: Iterable[Message] | None = None, *, timeout: float | None = None
    ) -> list[int]:
        """Token ids of text, or of chat messages rendered with the chat template."""
        request = build_tokenize_request(text, messages)
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
            status = self._health_status(_deadline_left(deadline))
            if status == "SERVING":
                return
            if _deadline_left(deadline) <= 0:
                raise _not_ready(status)
            time.sleep(min(READY_POLL_S, _deadline_left(deadline)))

    def _health_status(self, timeout: float) -> str:
        try:
            reply = self._health.Check(HEALTH_REQUEST, timeout=max(timeout, 0.01), metadata=self._metadata)
        except grpc.RpcError as error:
            if not _is_transient(error):
                raise
            return error.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

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
        self, text: str | None = None, messages: Iterable[Message] | None = None, *, timeout: float | None = None
    ) -> list[int]:
        """Token ids of text, or of chat messages rendered with the chat template."""
        request = build_tokenize_request(text, messages)
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
            status = await self._health_status(_deadline_left(deadline))
            if status == "SERVING":
                return
            if _deadline_left(deadline) <= 0:
                raise _not_ready(status)
            await asyncio.sleep(min(READY_POLL_S, _deadline_left(deadline)))

    async def _health_status(self, timeout: float) -> str:
        try:
            reply = await self._health.Check(HEALTH_REQUEST, timeout=max(timeout, 0.01), metadata=self._metadata)
        except grpc.aio.AioRpcError as error:
            if not _is_transient(error):
                raise
            return error.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
