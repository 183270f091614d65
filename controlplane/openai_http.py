"""OpenAI-compatible HTTP API beside the gRPC one: Starlette routes served by uvicorn on the same event loop.

POST /v1/chat/completions, /v1/completions and /v1/responses (streamed as server-sent events or not),
POST /tokenize and /detokenize, GET /v1/models, /v1/models/{model}, /health and /version. Requests go
to the same Engine as gRPC calls, with the same validation, API key and metrics. Errors become OpenAI's
JSON error objects here and nowhere else.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import importlib.metadata
import json
import logging
import math
import re
import resource
import socket
import time
from contextlib import contextmanager

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from twinplane.controlplane.api import REQUEST_ID_HEADER, checked_request_id, request_id_header_value
from twinplane.controlplane.auth import MESSAGE as API_KEY_MESSAGE
from twinplane.controlplane.engine import Engine
from twinplane.controlplane.errors import InvalidRequest, NotReady, ServiceError
from twinplane.controlplane.finish import misfit
from twinplane.controlplane.openai_api import PARAMS, detokenize_ids, parse_request, tokenize_prompt
from twinplane.controlplane.openai_responses import ResponsesBuilder, chat_body, fit_input
from twinplane.controlplane.openai_stream import Choices, ResponseBuilder
from twinplane.controlplane.tls import every_address, parse_listen
from twinplane.controlplane.tools import tags_are_special

log = logging.getLogger("twinplane.controlplane")


def _server_version() -> str:
    try:
        return importlib.metadata.version("twinplane")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


SERVER_VERSION = _server_version()
THREAD_PARSE_BYTES = 16 << 10  # bodies past this are parsed on a tokenizer thread (16 KB: ~0.3 ms inline)
_STATUS = {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "UNAUTHENTICATED": 401, "NOT_FOUND": 404,
           "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503, "INTERNAL": 500}
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          413: "invalid_request_error", 405: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable", 500: "server_error"}
_PARAM = re.compile(r"^([a-z_]+)(?:\[\d+\])?[ .:]")


class Unauthenticated(ServiceError):
    code_name = "UNAUTHENTICATED"
    code = "invalid_api_key"  # OpenAI's


class NotFound(ServiceError):
    code_name = "NOT_FOUND"

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


def error_response(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}
    return JSONResponse(body, status_code=status)


def response_of(exc: Exception) -> JSONResponse:
    """The one place where errors become HTTP statuses and OpenAI error objects."""
    if isinstance(exc, ServiceError):
        status, message = _STATUS[exc.code_name], str(exc)
        match = _PARAM.match(message) if status == 400 else None
        param = match.group(1) if match and match.group(1) in PARAMS else None
        return error_response(status, message, getattr(exc, "code", None), param)
    if isinstance(exc, HTTPException):
        return error_response(exc.status_code, str(exc.detail))
    log.exception("unexpected error while serving an HTTP request", exc_info=exc)
    return error_response(500, f"internal error ({type(exc).__name__}); the server keeps serving")


class OpenAIService:
    """The routes, over one engine."""

    def __init__(self, engine: Engine, api_key: str | None = None, max_body_bytes: int = 16 << 20):
        self.engine = engine
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())  # the model object's "created": when this server began serving it

    def app(self) -> Starlette:
        routes = [Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/responses", self.responses, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                  Route("/tokenize", self.tokenize, methods=["POST"]),
                  Route("/detokenize", self.detokenize, methods=["POST"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/version", self.version, methods=["GET"])]
        listing = ", ".join(f"{min(route.methods - {'HEAD'})} {route.path}" for route in routes)

        def http_error(request: Request, exc: HTTPException) -> JSONResponse:
            """Starlette's own errors, saying what the server has: no such route, or not with that method."""
            path = request.url.path
            if exc.status_code == 404:
                return error_response(404, f"{path} is not a route of this server: it has {listing}")
            if exc.status_code == 405:
                allowed = (exc.headers or {}).get("Allow", "")
                return error_response(405, f"{request.method} is not allowed on {path}; use {allowed}")
            return response_of(exc)

        handlers = {Exception: lambda request, exc: response_of(exc), HTTPException: http_error}
        return Starlette(routes=routes, exception_handlers=handlers)

    def _authorize(self, request: Request) -> None:
        sent = request.headers.get("authorization", "").encode()
        if self.expected is not None and not hmac.compare_digest(sent, self.expected):
            raise Unauthenticated(API_KEY_MESSAGE.replace("metadata", "header"))

    def _model_names(self) -> tuple[str, ...]:
        if self.engine.describe is None:
            raise NotReady("no data plane is connected yet; retry later")
        return self.engine.model_names

    async def health(self, request: Request) -> Response:
        serving = self.engine.serving
        return JSONResponse({"status": "SERVING" if serving else "NOT_SERVING"}, status_code=200 if serving else 503)

    async def version(self, request: Request) -> Response:
        """GET /version: this server's version, as vLLM's answers it (no key needed)."""
        return JSONResponse({"version": SERVER_VERSION})

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
            return JSONResponse({"object": "list", "data": [self._model_object(name) for name in self._model_names()]})
        except Exception as exc:  # noqa: BLE001 -- every error becomes an OpenAI error object
            return response_of(exc)

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id}: the served model under that name, or 404 for any other id."""
        try:
            self._authorize(request)
            return JSONResponse(self._model_object(self._check_model({"model": request.path_params["model"]})))
        except Exception as exc:  # noqa: BLE001 -- every error becomes an OpenAI error object
            return response_of(exc)

    def _model_object(self, name: str) -> dict:
        d = self.engine.describe
        return {"id": name, "object": "model", "created": self.created, "owned_by": "twinplane", "root": d.model,
                "max_model_len": d.max_model_len}

    async def tokenize(self, request: Request) -> Response:
        """A prompt's token ids, as the completion endpoints would see it (vLLM's /tokenize)."""
        async def answer(body: dict) -> dict:
            ids = await self.engine.tokenize(tokenize_prompt(body, self.engine.limits))
            return {"tokens": ids, "count": len(ids), "max_model_len": self.engine.limits.max_model_len}
        return await self._json(request, answer)

    async def detokenize(self, request: Request) -> Response:
        """Token ids back to text (vLLM's /detokenize)."""
        async def answer(body: dict) -> dict:
            engine = self.engine
            if engine.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer: there is no text for token ids")
            ids = detokenize_ids(body, engine.limits)
            # special tokens kept, as vLLM's: a chat prompt from /tokenize comes back with its template's markers
            return {"prompt": await engine.in_tokenizer_pool(engine.tokenizer.decode, ids, False)}
        return await self._json(request, answer)

    async def _json(self, request: Request, answer) -> Response:
        """A JSON body in, ``await answer(body)`` out; any error as an OpenAI error object."""
        try:
            self._authorize(request)
            body = await self._body(request)
            self._check_model(body)
            return JSONResponse(await answer(body))
        except Exception as exc:  # noqa: BLE001 -- every error becomes an OpenAI error object
            return response_of(exc)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def responses(self, request: Request) -> Response:
        return await self._generate(request, "response")

    async def _body(self, request: Request) -> dict:
        data = bytearray()
        async for part in request.stream():
            data += part
            if len(data) > self.max_body_bytes:
                raise HTTPException(413, f"the request body is over {self.max_body_bytes} bytes, the most this "
                                         "server takes (--max-message-mb)")
        try:  # never echo the body back
            # a large body on a tokenizer thread: 12 MB of token ids take ~0.1 s to parse, which would stall
            # every stream this frontend serves
            body = json.loads(data) if len(data) <= THREAD_PARSE_BYTES else \
                await self.engine.in_tokenizer_pool(json.loads, data)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise InvalidRequest("the request body is not valid JSON") from None
        except RecursionError:
            raise InvalidRequest("the request body nests JSON arrays or objects too deeply") from None
        except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
            raise InvalidRequest("the request body holds a number with too many digits") from None
        if not isinstance(body, dict):
            raise InvalidRequest("the request body must be a JSON object")
        return body

    def _check_model(self, body: dict) -> str:
        """The name the request asks for the model by (the first served name when it names none)."""
        served, asked = self._model_names(), body.get("model")
        if asked is None:
            return served[0]
        if not isinstance(asked, str):  # (never formatted: a large one would hold the event loop)
            raise InvalidRequest(f"model must be a string, got {type(asked).__name__}")
        if asked not in served:
            names = ", ".join(repr(name) for name in served)
            raise NotFound(f"the model {asked[:256]!r} does not exist; this server serves {names}", "model_not_found")
        return asked

    async def _fitted(self, chat: dict, instructions: bool) -> dict:
        """The Responses API's truncation "auto": the chat request less its earliest input messages, as few as
        let its prompt and max_output_tokens (1 when unset) fit max_model_len and the KV cache."""
        engine = self.engine
        most = chat.get("max_output_tokens")
        most = most if isinstance(most, int) and not isinstance(most, bool) and most > 0 else 1  # else refused later

        async def fits(fields: dict) -> bool:  # by the rule a request is refused by
            num_prompt_tokens = len(await engine.tokenize(tokenize_prompt(fields, engine.limits)))
            return misfit(num_prompt_tokens, most, engine.limits.max_model_len, engine.kv_capacity) is None

        return await fit_input(chat, int(instructions), fits)

    async def _generate(self, request: Request, kind: str) -> Response:
        """kind: "chat" (completions), "completion" or "response" (the Responses API)."""
        try:
            self._authorize(request)
            body = await self._body(request)
            if not self.engine.serving:  # refused at once, where a gRPC call would wait
                raise NotReady(self.engine.why_not_serving())
            model = self._check_model(body)
            self.engine.check_room()  # refused at once when too many wait
            # a chat or completion body's request_id (vLLM's); a Responses body's is not read
            request_id = _request_id({} if kind == "response" else body, request.headers.get(REQUEST_ID_HEADER))
            config = self.engine.config
            fields = chat_body(body) if kind == "response" else body
            if kind == "response" and body.get("truncation") == "auto":
                fields = await self._fitted(fields, body.get("instructions") is not None)
            chat, tokenizer, parser = kind != "completion", self.engine.tokenizer, config.tool_call_parser
            # on a tokenizer thread: a large schema's grammar takes 0.1-1 s to compile
            parsed = await self.engine.parse(parse_request, fields, self.engine.limits, request_id, chat, parser,
                                             tags_are_special(parser, tokenizer), config.reasoning_parser,
                                             tokenizer is not None and tokenizer.spaces_special_tokens)
            choices = Choices(self.engine, parsed)
            await choices.open()
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 -- every error becomes an OpenAI error object
            return response_of(exc)
        if kind == "response":
            builder = ResponsesBuilder(parsed, f"resp_{request_id}", model, body, config.reasoning_parser,
                                       config.tool_call_parser, self.engine.tokenizer)
            events = _response_sse(choices, builder)
        else:
            builder = ResponseBuilder(parsed, ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id, model,
                                      self.engine.tokenizer, config.reasoning_parser, config.tool_call_parser)
            events = _sse(choices, builder)
        headers = {REQUEST_ID_HEADER: request_id_header_value(request_id)}
        if parsed.stream:
            # the background task also aborts a stream the client left before its first chunk
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={**headers, "cache-control": "no-cache"},
                                     background=BackgroundTask(choices.aclose))
        return await _whole(request, choices, builder, headers)


def _request_id(body: dict, header: str | None) -> str:
    """The x-request-id header, else the body's request_id (vLLM's), else a new id; both checked as gRPC's are."""
    given = body.get("request_id")
    if given is not None and not isinstance(given, str):
        raise InvalidRequest(f"request_id must be a string, got {type(given).__name__}")
    return checked_request_id(given or "", _header_text(header), header_first=True)


def _header_text(value: str | None) -> str | None:
    """A header's value as the client wrote it. HTTP carries bytes, which Starlette reads as latin-1;
    non-ASCII ones that are UTF-8 (what clients send) are read as UTF-8 instead, so an id comes back
    percent-encoded once, as a gRPC request_id does, not as the UTF-8 of its latin-1 reading."""
    if value is None or value.isascii():
        return value
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return value


def _event(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


async def _sse(choices: Choices, builder: ResponseBuilder):
    """The stream: one event per output, the usage when asked for, then [DONE]; an error as an error event."""
    try:
        async for index, out in choices:
            for chunk in builder.chunks(index, out):
                yield _event(chunk)
        if builder.request.include_usage:
            yield _event(builder.usage_chunk(choices.usage()))
    except Exception as exc:  # noqa: BLE001 -- the status line is sent: the error goes as an event
        yield _event(json.loads(response_of(exc).body))
    finally:
        choices.close()
    yield _event("[DONE]")


async def _response_sse(choices: Choices, builder: ResponsesBuilder):
    """The Responses API's stream: named events, the last one the whole response; an error as an error event."""
    def named(event: dict) -> bytes:
        return f"event: {event['type']}\n".encode() + _event(event)

    try:
        for event in builder.start():
            yield named(event)
        async for index, out in choices:
            for event in builder.add(index, out):
                yield named(event)
        for event in builder.finish(choices.usage()):
            yield named(event)
    except Exception as exc:  # noqa: BLE001 -- the status line is sent: the error goes as an event
        error = json.loads(response_of(exc).body)["error"]
        yield named({"type": "error", "sequence_number": builder.sequence, "code": error["code"],
                     "message": error["message"], "param": error["param"]})
    finally:
        choices.close()


async def _whole(request: Request, choices: Choices, builder: ResponseBuilder | ResponsesBuilder,
                 headers: dict) -> Response:
    """Collects every output; a client that goes away meanwhile aborts the request."""
    async def collect() -> None:
        async for index, out in choices:
            builder.add(index, out)

    collecting = asyncio.ensure_future(collect())
    disconnect = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([collecting, disconnect], return_when=asyncio.FIRST_COMPLETED)
        if not collecting.done():
            collecting.cancel()
            return Response(status_code=499)
        collecting.result()
    except Exception as exc:  # noqa: BLE001 -- every error becomes an OpenAI error object
        return response_of(exc)
    finally:
        disconnect.cancel()
        choices.close()
    return JSONResponse(builder.response(choices.usage()), headers=headers)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the control plane owns SIGTERM and SIGINT."""

    @contextmanager
    def capture_signals(self):
        yield


_FULL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\nconnection: close\r\ncontent-length: 45"
         b"\r\n\r\nthis server holds all the connections it can\n")


class _Protocol(H11Protocol):
    """uvicorn's HTTP/1.1, bounded against clients that hold connections without using them: each request
    must arrive whole within client_timeout seconds (of the connection's start, or of the response before
    it), and a response the client does not take for client_timeout ends its connection; past
    max_connections open ones, a new connection gets 503 and is closed, so that HTTP clients never take
    the file descriptors gRPC and the engine core's channels need."""

    def __init__(self, *args, client_timeout: float, max_connections: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.client_timeout, self.max_connections = client_timeout, max_connections
        self._request_due: asyncio.TimerHandle | None = None  # the next request must be in by then
        self._write_due: asyncio.TimerHandle | None = None  # the client must take the paused output by then

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            _refusals.note(self.max_connections)
            transport.write(_FULL)
            transport.close()
            return
        self._await_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._await_request()

    def _await_request(self) -> None:
        if self._request_due is not None:
            self._request_due.cancel()
        self._request_due = self.loop.call_later(self.client_timeout, self._request_late)

    def _request_late(self) -> None:
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):  # no request yet, or part of one
            self.transport.abort()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._write_due = self.loop.call_later(self.client_timeout, self.transport.abort)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_due is not None:
            self._write_due.cancel()
            self._write_due = None

    def connection_lost(self, exc) -> None:
        for due in (self._request_due, self._write_due):
            if due is not None:
                due.cancel()
        super().connection_lost(exc)


class _Refusals:
    """Connections refused for the cap, logged at most every REFUSALS_LOGGED_EVERY seconds with how many
    (a client that opens connections in a loop would otherwise write a line for each)."""

    def __init__(self):
        self.count, self.logged_at = 0, -math.inf

    def note(self, cap: int) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.logged_at >= REFUSALS_LOGGED_EVERY:
            log.warning("HTTP: %d connections open, the most this frontend holds; refused %d connection(s)",
                        cap, self.count)
            self.count, self.logged_at = 0, now


REFUSALS_LOGGED_EVERY = 10.0
_refusals = _Refusals()


def connection_cap() -> int:
    """The most HTTP connections a frontend holds: three quarters of its open-file limit, which is first
    raised to the hard limit (as vLLM raises it); the rest stays for gRPC, the core's channels and files."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return max(16, min(soft, hard) * 3 // 4)


class HttpServer:
    """The HTTP API on an event loop that already runs (the control plane's)."""

    def __init__(self, engine: Engine, listen: str, api_key: str | None = None, max_body_bytes: int = 16 << 20,
                 tls_cert: str | None = None, tls_key: str | None = None, reuse_port: bool = False,
                 client_timeout: float = 60.0, max_connections: int | None = None):
        """reuse_port: share the port with the other frontend processes (SO_REUSEPORT); client_timeout and
        max_connections (None: ``connection_cap()``): what a client is allowed (``_Protocol``)."""
        host, port = parse_listen(listen)
        self.host = every_address(host)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # bound now: errors come early
        try:
            self.socket = socket.create_server((self.host, port), family=family, reuse_port=reuse_port,
                                               dualstack_ipv6=self.host == "::" and socket.has_dualstack_ipv6())
        except OSError as exc:
            raise OSError(f"--http-listen {listen}: cannot listen there: {exc.strerror or exc}") from None
        self.port = self.socket.getsockname()[1]
        app = OpenAIService(engine, api_key, max_body_bytes).app()
        protocol = functools.partial(_Protocol, client_timeout=client_timeout,
                                     max_connections=max_connections or connection_cap())
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", ws="none", http=protocol,
                                timeout_graceful_shutdown=1, ssl_certfile=tls_cert, ssl_keyfile=tls_key)
        # uvicorn writes a warning for each malformed request, which any client could send in a loop: its
        # errors only, unless everything is asked for (DEBUG)
        if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
            logging.getLogger("uvicorn.error").setLevel(logging.ERROR)
        self.server = _Server(config)
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.socket]), name="twinplane-http")
        while not self.server.started and not self.task.done():
            await asyncio.sleep(0.01)
        if self.task.done():
            self.task.result()  # raises what stopped it

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)
        self.socket.close()
