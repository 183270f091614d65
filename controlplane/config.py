"""Configuration of the control-plane process, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import jinja2

from twinplane.controlplane.generation_config import check_flags
from twinplane.controlplane.reasoning import REASONING_PARSERS
from twinplane.controlplane.router import ROUTING_POLICIES
from twinplane.controlplane.scheduler import check_step_limits
from twinplane.controlplane.tls import DataPlaneTls, check_listen, check_target, parse_listen
from twinplane.controlplane.tokenizer import Tokenizer
from twinplane.controlplane.tools import TOOL_CALL_PARSERS

SCHEDULING_POLICIES = ("fcfs", "priority")
BYTES_PER_TOKEN = 64  # default max_prompt_bytes per token of max_model_len (generous: room for truncation)
MAX_DATAPLANE_TIMEOUT = 86_400.0  # seconds; keepalive pings take half of it in int32 milliseconds
MAX_API_SERVERS = 64  # frontend processes (each a Python process with its own tokenizer and socket to the core)


@dataclass(frozen=True)
class ControlPlaneConfig:
    dataplane: str  # gRPC target of the data plane, e.g. "127.0.0.1:50061" or "unix:///tmp/dp.sock"
    dataplane_token: str | None = None  # shared secret the data plane may require
    dataplane_tls: DataPlaneTls = DataPlaneTls()  # TLS to data planes on TCP; default: plaintext
    listen: str = "127.0.0.1:50051"  # public API address (loopback unless told otherwise)
    tokenizer: str | None = None  # tokenizer folder; default: the one the data plane reports
    chat_template: str | None = None  # a chat template's text, in place of the tokenizer's; None: the tokenizer's
    max_num_seqs: int | None = None  # default: the data plane's limit
    max_num_batched_tokens: int | None = None  # default: the data plane's limit
    max_waiting_requests: int = 4096  # beyond this, new requests get RESOURCE_EXHAUSTED
    enable_prefix_caching: bool = True
    max_logprobs: int = 20
    max_stop_strings: int = 16
    max_stop_string_len: int = 256
    max_message_bytes: int = 16 * 1024 * 1024  # largest gRPC message either way, and HTTP request body
    max_prompt_bytes: int | None = None  # text or chat bytes a request may send; default: BYTES_PER_TOKEN per token
    max_chat_messages: int = 1024  # chat messages a request may send
    tokenizer_threads: int = 2  # prompts tokenized (and chat templates rendered) at once, off the event loop
    max_unsent_tokens_per_stream: int = 1024  # tokens queued for a stream that is not read; beyond: aborted
    max_unsent_tokens: int = 65536  # the same, over every stream of the frontend
    shutdown_grace: float = 10.0  # seconds in-flight streams get to finish on SIGTERM
    max_prefill_tokens_with_decode: int | None = None  # cap on prefill tokens in steps that also decode
    stream_interval: int = 1  # tokens per streamed message (fewer messages at high load)
    max_steps_in_flight: int = 2  # steps planned and sent before the oldest one's result is applied
    decode_steps: int = 8  # decode steps in one plan when few sequences decode and none waits (1: one per plan)
    decode_steps_max_seqs: int = 4  # the most sequences such a plan takes
    metrics_port: int | None = None  # Prometheus /metrics over HTTP on this port (0: any free one); None: off
    metrics_host: str = "127.0.0.1"  # address /metrics binds to
    metrics_api_key: bool = True  # with an API key, /metrics requires it too
    # Liveness, in seconds: a step result or an engine-core heartbeat later than stall_timeout makes
    # health NOT_SERVING until it comes; a data plane silent for dataplane_timeout is dropped and
    # reconnected to (keepalive pings find a silent connection within it even when idle); an engine
    # core silent for core_timeout is killed and restarted.
    stall_timeout: float = 5.0
    dataplane_timeout: float = 30.0
    core_timeout: float = 30.0
    http_listen: str | None = None  # OpenAI-compatible HTTP API: "host:port" or a port (loopback); None: off
    # Seconds an HTTP client has to send a whole request, and to take a response that waits for it to read;
    # past them its connection is closed.
    http_client_timeout: float = 60.0
    routing: str = "prefix"  # which data plane a new request goes to, with several (router.py)
    # Frontend processes (gRPC and HTTP servers, tokenizing, streaming) sharing the listening ports and
    # one engine core (frontends.py); the request limits above are split evenly between them.
    api_server_count: int = 1
    # The names clients may ask for the model by (OpenAI's "model"); the first is the one reported.
    # Empty: the data plane's own name for it.
    served_model_names: tuple[str, ...] = ()
    # Chat completions' text split into reasoning_content and content (reasoning.py); None: off.
    reasoning_parser: str | None = None
    # Chat completions' tool calls found in the text (tools.py), for requests with tool_choice "auto"; None: off.
    tool_call_parser: str | None = None
    # "fcfs": first come, first served; "priority": by each request's priority (lower first), then arrival.
    scheduling_policy: str = "fcfs"
    # The defaults of what a request leaves unset (generation_config.py): "auto", those of the model's
    # generation_config.json as the data plane read it; "vllm", none; else a folder whose generation_config.json
    # is read here. Over them, override_generation_config's keys (a None: the built-in default).
    generation_config: str = "auto"
    override_generation_config: dict = field(default_factory=dict)

    @property
    def dataplanes(self) -> tuple[str, ...]:
        """The data planes' gRPC targets: dataplane is one, or several separated by commas."""
        return tuple(target.strip() for target in self.dataplane.split(",") if target.strip())

    def __post_init__(self) -> None:
        if not self.dataplanes:
            raise ValueError("dataplane: give at least one data-plane address")
        if len(set(self.dataplanes)) < len(self.dataplanes):
            twice = sorted({t for t in self.dataplanes if self.dataplanes.count(t) > 1})
            raise ValueError(f"dataplane: {', '.join(twice)} given more than once; give each data plane once")
        for target in self.dataplanes:
            check_target(target)
        check_listen(self.listen)
        if self.tokenizer is not None and not (Path(self.tokenizer) / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer: no tokenizer.json in {self.tokenizer}: give the folder of the model's "
                             "tokenizer files")
        if self.listen in self.dataplanes:
            raise ValueError(f"listen: {self.listen} is a data plane's address too; give the control plane one of "
                             "its own")
        if self.http_listen is not None:
            parse_listen(self.http_listen)
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        if self.chat_template is not None:
            try:
                Tokenizer.compile_template(self.chat_template)
            except jinja2.TemplateError as exc:
                raise ValueError(f"chat_template does not compile: {exc}") from None
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_tokens_with_decode"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.max_num_seqs is not None and self.max_num_batched_tokens is not None:
            check_step_limits(self.max_num_seqs, self.max_num_batched_tokens)
        if self.max_steps_in_flight < 1:
            raise ValueError(f"max_steps_in_flight must be >= 1, got {self.max_steps_in_flight}")
        if not 1 <= self.decode_steps <= 64:
            raise ValueError(f"decode_steps must be in [1, 64], got {self.decode_steps}")
        if self.decode_steps_max_seqs < 1:
            raise ValueError(f"decode_steps_max_seqs must be >= 1, got {self.decode_steps_max_seqs}")
        if self.stream_interval <= 0:
            raise ValueError(f"stream_interval must be > 0, got {self.stream_interval}")
        if self.max_waiting_requests <= 0:
            raise ValueError("max_waiting_requests must be > 0")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        for name in ("max_chat_messages", "tokenizer_threads", "max_unsent_tokens_per_stream", "max_unsent_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.max_message_bytes < 1 << 31:  # gRPC's limits are 32-bit
            raise ValueError(f"max_message_bytes must be in [1, 2 GiB), got {self.max_message_bytes}")
        if not 0 < self.http_client_timeout < float("inf"):
            raise ValueError(f"http_client_timeout must be > 0 seconds, got {self.http_client_timeout}")
        if self.max_prompt_bytes is not None and self.max_prompt_bytes <= 0:
            raise ValueError(f"max_prompt_bytes must be > 0, got {self.max_prompt_bytes}")
        self._check_api_server_count()
        check_flags(self.generation_config, self.override_generation_config)
        check_secret(self.dataplane_token, "the data-plane token (--dataplane-token or TWINPLANE_DATAPLANE_TOKEN)")
        names = self.served_model_names
        if any(not name.strip() for name in names) or len(set(names)) != len(names):
            raise ValueError(f"served_model_names must be distinct and not blank, got {list(names)}")
        if self.max_logprobs < 0:
            raise ValueError("max_logprobs must be >= 0")
        if not self.shutdown_grace >= 0:
            raise ValueError(f"shutdown_grace must be >= 0, got {self.shutdown_grace}")
        if not self.stall_timeout > 0:
            raise ValueError(f"stall_timeout must be > 0, got {self.stall_timeout}")
        for name in ("dataplane_timeout", "core_timeout"):
            if not getattr(self, name) > self.stall_timeout:
                raise ValueError(f"{name} must be > stall_timeout ({self.stall_timeout}), got {getattr(self, name)}")
        if not self.dataplane_timeout <= MAX_DATAPLANE_TIMEOUT:  # gRPC's keepalive times are int32 milliseconds
            raise ValueError(f"dataplane_timeout must be at most {MAX_DATAPLANE_TIMEOUT} seconds (a day), "
                             f"got {self.dataplane_timeout}")

    def _check_api_server_count(self) -> None:
        n = self.api_server_count
        if not 1 <= n <= MAX_API_SERVERS:
            raise ValueError(f"api_server_count must be in [1, {MAX_API_SERVERS}] (frontend processes), got {n}")
        if n > 1 and self.listen.startswith("unix:"):
            raise ValueError(f"api_server_count {n} needs a TCP listen address (host:port): the frontends share "
                             f"its port, and a unix socket ({self.listen}) cannot be shared")
        for name in ("max_waiting_requests", "max_unsent_tokens"):
            if getattr(self, name) < n:
                raise ValueError(f"{name} ({getattr(self, name)}) is split between the {n} frontends: "
                                 f"give at least {n}")

    def share(self, limit: int) -> int:
        """One frontend's share of a limit of the whole service (max_waiting_requests, max_unsent_tokens)."""
        return limit // self.api_server_count


def check_secret(value: str | None, name: str) -> None:
    """A key or token travels in gRPC metadata, which carries printable ASCII only: any other is refused
    here (ValueError naming it), at start-up, and not by every call."""
    if value and not all("!" <= c <= "~" for c in value):
        raise ValueError(f"{name} must be printable ASCII, without spaces or line breaks (a value read from a "
                         "file may end with a newline)")
