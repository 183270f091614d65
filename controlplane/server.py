"""The public gRPC API: Generation service, health and reflection.

The servicer is thin: from_pb -> engine -> to_pb. ServiceError subclasses
become gRPC status codes here and nowhere else.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import replace

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from twinplane.controlplane.api import (REQUEST_ID_HEADER, GenerateCall, forces_calls, generate_call_from_pb,
                                        output_to_pb, prompt_from_pb, request_id_header_value)
from twinplane.controlplane.chat_text import ChatText
from twinplane.controlplane.engine import Engine
from twinplane.controlplane.errors import InvalidRequest, ServiceError
from twinplane.controlplane.tls import add_port
from twinplane.controlplane.tools import tags_are_special
from twinplane.proto import generation_pb2 as pb
from twinplane.proto import generation_pb2_grpc as pb_grpc

log = logging.getLogger("twinplane.controlplane")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def status_of(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The one place where errors become gRPC status codes."""
    if isinstance(exc, ServiceError):
        return getattr(grpc.StatusCode, exc.code_name), str(exc)
    log.exception("unexpected error while serving a call", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); the server keeps serving"


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    await context.abort(*status_of(exc))


_ending: set[asyncio.Task] = set()  # calls being ended by _end_call (held until done)


def _end_call(context: grpc.aio.ServicerContext, handler: asyncio.Task, exc: Exception) -> None:
    """Ends a call with exc, even one whose handler waits on a write its client never reads: the handler
    stops now and the status goes out behind what gRPC already holds for the client (HTTP/2 sends a
    stream's trailers after its data, and a gRPC client reports the status after the messages before
    it). A client that reads again gets them, then the status; one that never does ends the call by
    its deadline or by leaving, and the status is dropped with it: nothing to report as an error."""
    async def abort() -> None:
        try:
            await _abort(context, exc)
        except grpc.aio.AbortError:
            pass
        except Exception as error:  # noqa: BLE001 -- the send failed: the client left before it read the status
            log.debug("a call ended before its status (%s) reached the client: %r", status_of(exc)[0].name, error)

    task = asyncio.ensure_future(abort())
    _ending.add(task)
    task.add_done_callback(_ending.discard)
    asyncio.get_running_loop().call_soon(handler.cancel)


class Undecodable:
    """Stands in for a request whose bytes are not a valid message, so the servicer can refuse it."""

    def __init__(self, error: Exception):
        self.error = error


def _check_decoded(request) -> None:
    if isinstance(request, Undecodable):
        raise InvalidRequest(f"the request is not a valid protobuf message of this method: {request.error}")


class DecodeErrorsInterceptor(grpc.aio.ServerInterceptor):
    """Undecodable requests to the Generation service become INVALID_ARGUMENT (gRPC says UNKNOWN)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        decode = handler.request_deserializer

        def lenient(data: bytes):
            try:
                return decode(data)
            except DecodeError as exc:
                return Undecodable(exc)

        return handler._replace(request_deserializer=lenient)


def unary_errors(method):
    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            _check_decoded(request)
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 -- mapped to a status code, never lost
            await _abort(context, exc)
    return wrapper


def stream_errors(method):
    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            _check_decoded(request)
            async for item in method(self, request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 -- mapped to a status code, never lost
            await _abort(context, exc)
    return wrapper


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, engine: Engine):
        self.engine = engine

    @stream_errors
    async def Generate(self, request: pb.GenerateRequest, context):
        engine = self.engine
        await engine.wait_ready(queued=True)
        header = dict(context.invocation_metadata() or ()).get(REQUEST_ID_HEADER)
        config = engine.config
        # on a tokenizer thread: a large schema's grammar takes 0.1-1 s to compile
        call = await engine.parse(generate_call_from_pb, request, engine.limits, header, config.tool_call_parser,
                                  config.reasoning_parser)
        call, parts = self._output_parts(request, call) if request.parse_output else (call, None)
        state = await engine.add(call)
        # cancelled, deadline passed or connection lost: free the blocks now, not when the handler unwinds
        context.add_done_callback(lambda _: engine.abort(state))
        state.end_call = functools.partial(_end_call, context, asyncio.current_task())
        await context.send_initial_metadata(((REQUEST_ID_HEADER, request_id_header_value(state.request_id)),))
        async for out in engine.outputs(state):
            message = output_to_pb(out)
            if parts is not None:  # the answer in text; the reasoning and the tool calls apart
                reasoning, message.text, calls = parts.take(out)
                message.reasoning_text = reasoning
                message.tool_calls.extend(pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls)
                message.tool_call_deltas.extend(
                    pb.ToolCallDelta(index=d.index, id=d.call.id if d.begins else "",
                                     name=d.call.name if d.begins else "", arguments=d.arguments)
                    for d in parts.deltas(calls) if d.adds)
            yield message

    def _output_parts(self, request: pb.GenerateRequest, call: GenerateCall) -> tuple[GenerateCall, ChatText]:
        """parse_output: the splitter of the request's text, with the server's parsers (the tool call
        parser when the request has tools and a tool_choice other than "none", as the OpenAI API reads
        it); the call keeps special tokens when the parser's tags are."""
        config = self.engine.config
        if request.WhichOneof("input") != "chat":
            raise InvalidRequest("parse_output is for chat input: send chat messages, or leave parse_output false")
        if not (config.reasoning_parser or config.tool_call_parser):
            raise InvalidRequest("parse_output needs a server started with --reasoning-parser or --tool-call-parser; "
                                 "this one returns the text as written")
        parser = config.tool_call_parser if request.chat.tools and request.chat.tool_choice != "none" else None
        if tags_are_special(parser, self.engine.tokenizer):
            call = replace(call, params=replace(call.params, skip_special_tokens=False))
        return call, ChatText(config.reasoning_parser, parser, calls_only=forces_calls(request),
                              tokenizer=self.engine.tokenizer)

    @unary_errors
    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        await self.engine.wait_ready()
        if request.WhichOneof("input") is None:
            raise InvalidRequest("input is required: set text or chat")
        engine = self.engine
        ids = await engine.tokenize(prompt_from_pb(request, engine.limits))
        texts = await engine.in_tokenizer_pool(engine.tokenizer.token_texts, ids)
        return pb.TokenizeResponse(token_ids=ids, tokens=texts)

    @unary_errors
    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        await self.engine.wait_ready()
        d, limits = self.engine.describe, self.engine.limits
        tok = self.engine.tokenizer
        return pb.ModelInfo(
            model=self.engine.model_names[0], architecture=d.architecture, vocab_size=d.vocab_size,
            max_model_len=d.max_model_len,
            dtype=d.dtype, block_size=d.block_size, num_kv_blocks=d.num_kv_blocks,
            tensor_parallel_size=d.tensor_parallel_size, attention_backend=d.attention_backend,
            eos_token_ids=list(d.eos_token_ids), max_logprobs=limits.max_logprobs,
            has_chat_template=bool(tok and tok.chat_template), weight_bytes=d.weight_bytes,
            kv_bytes_per_token=d.kv_bytes_per_token, device=d.device,
            data_parallel_size=len(self.engine.config.dataplanes), max_num_seqs=d.max_num_seqs,
            max_num_batched_tokens=d.max_num_batched_tokens, hidden_size=d.hidden_size,
            num_hidden_layers=d.num_hidden_layers, num_attention_heads=d.num_attention_heads, head_dim=d.head_dim,
            layer_params=d.layer_params, reasoning_parser=self.engine.config.reasoning_parser or "",
            tool_call_parser=self.engine.config.tool_call_parser or "", kv_cache_dtype=d.kv_cache_dtype,
            generation_defaults=limits.defaults)


    @unary_errors
    async def GetStats(self, request, context) -> pb.ServerStats:
        await self.engine.wait_ready()
        core = self.engine.core_snapshot
        dataplanes = [pb.DataPlaneStats(
            target=d.target, connected=d.connected, waiting=d.waiting, running=d.running,
            free_kv_blocks=d.free_kv_blocks, num_kv_blocks=d.num_kv_blocks, steps=d.steps,
            computed_tokens=d.computed_tokens, preemptions=d.num_preemptions,
            prefix_cache_queries=d.prefix_cache_queries, prefix_cache_hits=d.prefix_cache_hits)
            for d in self.engine.dataplanes]
        return pb.ServerStats(**core.stats, preemptions=core.num_preemptions, waiting=self.engine.num_waiting,
                              running=core.running, free_kv_blocks=core.free_kv_blocks,
                              prefix_cache_queries=core.prefix_cache_queries,
                              prefix_cache_hits=core.prefix_cache_hits, dataplanes=dataplanes,
                              frontend=self.engine.index, api_server_count=self.engine.config.api_server_count)


def create_server(engine: Engine, listen: str, *, max_message_bytes: int = 16 << 20,
                  credentials: grpc.ServerCredentials | None = None, interceptors=(),
                  reuse_port: bool = False) -> tuple[grpc.aio.Server, int]:
    """Builds the public server (not started); returns it and the bound port. reuse_port: the port is
    shared with the other frontend processes (SO_REUSEPORT); else a port in use fails to bind."""
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max_message_bytes), ("grpc.so_reuseport", int(reuse_port))]
    server = grpc.aio.server(options=options, interceptors=[*interceptors, DecodeErrorsInterceptor()])
    pb_grpc.add_GenerationServicer_to_server(GenerationServicer(engine), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)

    def set_health(ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            asyncio.ensure_future(health_servicer.set(name, status))

    set_health(engine.serving)
    engine.on_readiness.append(set_health)
    _enable_reflection(server, (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name))
    return server, add_port(server, listen, credentials)


def _enable_reflection(server: grpc.aio.Server, service_names: tuple[str, ...]) -> None:
    """Server reflection as grpc.reflection.v1 (what current tools ask first) and v1alpha. grpcio-reflection
    implements v1alpha only; v1 has the same messages under another package, so one servicer serves both."""
    _add_v1_reflection_descriptors()
    servicer = reflection.aio.ReflectionServicer((*service_names, REFLECTION_V1, reflection.SERVICE_NAME))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    info = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo, request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1,
                                                                          {"ServerReflectionInfo": info}),))


def _add_v1_reflection_descriptors() -> None:
    """grpc/reflection/v1/reflection.proto in the default pool (so reflection can describe v1 itself),
    made from the v1alpha file: the same messages and service, renamed."""
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(REFLECTION_V1)
        return
    except KeyError:
        pass
    old, new = reflection_pb2.DESCRIPTOR.package, REFLECTION_V1.rpartition(".")[0]
    file = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(file)
    file.name, file.package = "grpc/reflection/v1/reflection.proto", new
    file.ClearField("options")
    for field in (f for message in file.message_type for f in message.field if f.type_name):
        field.type_name = field.type_name.replace(f".{old}.", f".{new}.")
    for method in file.service[0].method:
        method.input_type = method.input_type.replace(f".{old}.", f".{new}.")
        method.output_type = method.output_type.replace(f".{old}.", f".{new}.")
    pool.Add(file)
