"""Configuration of the control-plane process, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ControlPlaneConfig:
    dataplane: str  # gRPC target of the data plane, e.g. "127.0.0.1:50061" or "unix:///tmp/dp.sock"
    dataplane_token: str | None = None  # shared secret the data plane may require
    listen: str = "127.0.0.1:50051"  # public API address (loopback unless told otherwise)
    tokenizer: str | None = None  # tokenizer folder; default: the one the data plane reports
    max_num_seqs: int | None = None  # default: the data plane's limit
    max_num_batched_tokens: int | None = None  # default: the data plane's limit
    max_waiting_requests: int = 4096  # beyond this, new requests get RESOURCE_EXHAUSTED
    enable_prefix_caching: bool = True
    max_logprobs: int = 20
    max_stop_strings: int = 16
    max_stop_string_len: int = 256
    max_message_bytes: int = 16 * 1024 * 1024
    shutdown_grace: float = 10.0  # seconds in-flight streams get to finish on SIGTERM
    max_prefill_tokens_with_decode: int | None = None  # cap on prefill tokens in steps that also decode
    stream_interval: int = 1  # tokens per streamed message (fewer messages at high load)
    max_steps_in_flight: int = 2  # steps planned and sent before the oldest one's result is applied
    metrics_port: int | None = None  # Prometheus /metrics over HTTP on this port (0: any free one); None: off
    metrics_host: str | None = None  # default: the host of listen (127.0.0.1 for a unix socket)
    http_listen: str | None = None  # OpenAI-compatible HTTP API: "host:port" or a port (loopback); None: off

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_tokens_with_decode"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.max_steps_in_flight < 1:
            raise ValueError(f"max_steps_in_flight must be >= 1, got {self.max_steps_in_flight}")
        if self.stream_interval <= 0:
            raise ValueError(f"stream_interval must be > 0, got {self.stream_interval}")
        if self.max_waiting_requests <= 0:
            raise ValueError("max_waiting_requests must be > 0")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.max_logprobs < 0:
            raise ValueError("max_logprobs must be >= 0")
