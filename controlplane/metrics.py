"""Prometheus metrics of the control plane, on a registry of each server's own.

The frontend only bumps plain numbers (ints and bucket counts, a few hundred
nanoseconds per streamed message); prometheus_client turns them into the text
format when /metrics is scraped, on its HTTP server's thread. Gauges (running,
waiting, KV usage), the scheduler's counters and the data-plane step times come
from the engine core's latest snapshot. Only the event loop writes, and the scrape
copies each list before it reads it, so no lock is needed.

Names follow vLLM's (``vllm:`` becomes ``twinplane:``) where the meaning is the same, and every
series carries vLLM's ``model_name`` label (the first served model name), so dashboards and alert
rules written for vLLM select it. The text is always Prometheus's 0.0.4 format, whatever the scrape
asks for: its names keep their colons (the OpenMetrics output of prometheus_client would rewrite
them for a scraper that does not ask for UTF-8 names).
"""

from __future__ import annotations

import bisect
import gzip
import hmac
import io
import math
import socket
import sys
import threading
import time
from collections.abc import Iterator
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from twinplane.controlplane.sequence import FinishReason
from twinplane.controlplane.tls import every_address

if TYPE_CHECKING:
    from twinplane.controlplane.engine import Engine
    from twinplane.controlplane.frontends import Secondaries
    from twinplane.controlplane.request_state import RequestState

PREFIX = "twinplane:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # what generate_latest writes
# Bucket upper bounds, in seconds: finer than vLLM's at the low end (a decode step here takes a few
# milliseconds), up to vLLM's highest bounds at the other.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                       0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Token counts per request: 1, 2, 5, 10, 20, 50, ... (vLLM's 1-2-5 series), up to 5 million.
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))
# How a request ended: the finish reasons, and "error" for one that ended with an error status
# (its stream not read, its step failed, the server shut down, ...), as vLLM's finished_reason.
ENDINGS = (*(reason.value for reason in FinishReason), "error")
# The phases of a request that ended, vLLM's: request_<phase>_time_seconds.
PHASES = {"queue": "Seconds from arrival until the engine core first scheduled it.",
          "prefill": "Seconds from its first scheduling to its first token.",
          "decode": "Seconds from its first token to its last.",
          "inference": "Seconds from its first scheduling to its last token."}
# The per-data-plane counters (DataPlaneSnapshot fields) of /metrics and GetStats, which carry on across engine
# cores (a new core counts them from 0).
DATAPLANE_COUNTERS = ("steps", "computed_tokens", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits")


class Histogram:
    """Bucket counts and a sum; observe() is one bisect and two additions."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket (not cumulative); the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """Records value count times."""
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def add(self, other: Histogram) -> None:
        """Adds other's observations (same bounds)."""
        self.counts = [a + b for a, b in zip(self.counts, list(other.counts))]
        self.sum += other.sum

    def family(self, name: str, documentation: str, model: str) -> HistogramMetricFamily:
        counts, total = list(self.counts), self.sum
        cumulative, buckets = 0, []
        for bound, count in zip((*self.bounds, math.inf), counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family = HistogramMetricFamily(name, documentation, labels=["model_name"])
        family.add_metric([model], buckets, total)
        return family


class EngineMetrics:
    """What the step loop counts as requests stream and finish."""

    def __init__(self) -> None:
        self.prompt_tokens = 0  # counted when a request's first token goes out (its prefill is done)
        self.generation_tokens = 0  # counted as streamed
        self.finished = dict.fromkeys(ENDINGS, 0)  # every label exists from the start
        self.time_to_first_token = Histogram(TTFT_BUCKETS)
        self.inter_token_latency = Histogram(INTER_TOKEN_BUCKETS)
        self.e2e_request_latency = Histogram(E2E_BUCKETS)
        self.request_prompt_tokens = Histogram(TOKEN_BUCKETS)
        self.request_generation_tokens = Histogram(TOKEN_BUCKETS)
        # vLLM's phases of a request: queued (arrival to first scheduled), prefill (to its first token),
        # decode (first token to last), inference (first scheduled to last token)
        self.request_queue_time = Histogram(TTFT_BUCKETS)
        self.request_prefill_time = Histogram(TTFT_BUCKETS)
        self.request_decode_time = Histogram(E2E_BUCKETS)
        self.request_inference_time = Histogram(E2E_BUCKETS)

    def request_finished(self, ending: str, state: RequestState, now: float) -> None:
        """A request ended (ending: an ENDINGS value), at now (time.monotonic()): each phase it reached is
        observed."""
        self.finished[ending] += 1
        self.e2e_request_latency.observe(now - state.arrival_time)
        self.request_prompt_tokens.observe(state.num_prompt_tokens)
        self.request_generation_tokens.observe(state.num_outputs)
        scheduled, first, last = state.scheduled_time, state.first_token_time, state.last_token_time
        if scheduled is not None:
            self.request_queue_time.observe(max(scheduled - state.arrival_time, 0.0))
        if first is not None:
            self.request_decode_time.observe(last - first)
            if scheduled is not None:
                self.request_prefill_time.observe(max(first - scheduled, 0.0))
                self.request_inference_time.observe(max(last - scheduled, 0.0))

    @classmethod
    def total(cls, parts: list[EngineMetrics]) -> EngineMetrics:
        """The sum of several frontends' metrics."""
        total = cls()
        for part in parts:
            total.prompt_tokens += part.prompt_tokens
            total.generation_tokens += part.generation_tokens
            for reason, count in list(part.finished.items()):
                total.finished[reason] += count
            for name in HISTOGRAMS:
                getattr(total, name).add(getattr(part, name))
        return total


HISTOGRAMS = ("time_to_first_token", "inter_token_latency", "e2e_request_latency", "request_prompt_tokens",
              "request_generation_tokens", "request_queue_time", "request_prefill_time", "request_decode_time",
              "request_inference_time")


class EngineCollector:
    """Reads an engine's numbers into Prometheus metric families at scrape time; with several
    frontends, the request counters and histograms are summed over all of them (the others'
    as they last reported them, at most HEARTBEAT_INTERVAL ago)."""

    def __init__(self, engine: Engine, secondaries: Secondaries | None = None):
        self.engine = engine
        self.secondaries = secondaries

    def collect(self) -> Iterator[Metric]:
        m = self.engine.metrics
        if self.secondaries is not None:
            m = EngineMetrics.total([m, *list(self.secondaries.metrics.values())])
        model = self.engine.model_name
        yield from self._gauges(model)
        yield from self._counters(m, model)
        yield from self._histograms(m, model)
        yield from self._per_dataplane(model)

    def _per_dataplane(self, model: str) -> Iterator[Metric]:
        """Each data plane's share, labelled by its address (several with data parallelism); its
        counters carry on across engine-core restarts."""
        parts = self.engine.dataplanes
        families = (
            (GaugeMetricFamily, "dataplane_connected", "1 while the control plane is connected to the data plane.",
             lambda d: int(d.connected)),
            (GaugeMetricFamily, "dataplane_requests_running", "Requests running on the data plane.",
             lambda d: d.running),
            (GaugeMetricFamily, "dataplane_requests_waiting", "Requests queued for the data plane.",
             lambda d: d.waiting),
            (GaugeMetricFamily, "dataplane_free_kv_blocks", "Free KV blocks on the data plane.",
             lambda d: d.free_kv_blocks),
            (CounterMetricFamily, "dataplane_computed_tokens", "Tokens the data plane computed.",
             lambda d: d.computed_tokens),
            (CounterMetricFamily, "dataplane_prefix_cache_hits", "Tokens found in the data plane's prefix cache.",
             lambda d: d.prefix_cache_hits),
        )
        for kind, name, documentation, value in families:
            family = kind(f"{PREFIX}{name}", documentation, labels=["model_name", "dataplane"])
            for part in parts:
                family.add_metric([model, part.target], value(part))
            yield family

    def _gauges(self, model: str) -> Iterator[Metric]:
        core = self.engine.core_snapshot
        usage = 0.0
        if core.num_kv_blocks:
            usage = min(1.0, max(0.0, 1.0 - core.free_kv_blocks / core.num_kv_blocks))
        yield _one(GaugeMetricFamily, "num_requests_running", "Requests holding KV blocks and scheduled every step.",
                   model, core.running)
        yield _one(GaugeMetricFamily, "num_requests_waiting", "Requests queued for admission (including preempted "
                   "ones and those waiting for a data plane).", model, self.engine.num_waiting)
        yield _one(GaugeMetricFamily, "kv_cache_usage_perc", "Share of KV-cache blocks held by requests (0 to 1).",
                   model, usage)

    def _counters(self, m: EngineMetrics, model: str) -> Iterator[Metric]:
        core = self.engine.core_snapshot
        yield _one(CounterMetricFamily, "prefix_cache_queries", "Tokens looked up in the prefix cache at admission.",
                   model, core.prefix_cache_queries)
        yield _one(CounterMetricFamily, "prefix_cache_hits", "Tokens found in the prefix cache at admission.",
                   model, core.prefix_cache_hits)
        yield _one(CounterMetricFamily, "num_preemptions", "Sequences preempted (KV blocks freed, recomputed later).",
                   model, core.num_preemptions)
        yield _one(CounterMetricFamily, "prompt_tokens", "Prompt tokens of requests that produced a first token.",
                   model, m.prompt_tokens)
        yield _one(CounterMetricFamily, "generation_tokens", "Tokens generated and streamed.", model,
                   m.generation_tokens)
        success = CounterMetricFamily(f"{PREFIX}request_success", "Requests ended, by finish reason ('error': "
                                      "ended with an error status).", labels=["model_name", "finished_reason"])
        for ending, count in list(m.finished.items()):
            success.add_metric([model, ending], count)
        yield success

    def _histograms(self, m: EngineMetrics, model: str) -> Iterator[Metric]:
        step = self.engine.core_snapshot.dataplane_step
        yield m.time_to_first_token.family(f"{PREFIX}time_to_first_token_seconds",
                                           "Seconds from arrival to the first streamed token.", model)
        yield m.inter_token_latency.family(f"{PREFIX}inter_token_latency_seconds",
                                           "Seconds between streamed tokens (a message's gap over its tokens).", model)
        yield m.e2e_request_latency.family(f"{PREFIX}e2e_request_latency_seconds",
                                           "Seconds from arrival to the end of a request.", model)
        yield m.request_prompt_tokens.family(f"{PREFIX}request_prompt_tokens",
                                             "Prompt tokens of each request that ended.", model)
        yield m.request_generation_tokens.family(f"{PREFIX}request_generation_tokens",
                                                 "Tokens generated for each request that ended.", model)
        for phase, what in PHASES.items():
            yield getattr(m, f"request_{phase}_time").family(f"{PREFIX}request_{phase}_time_seconds", what, model)
        yield step.family(f"{PREFIX}dataplane_step_seconds",
                          "Seconds the data plane spent on one step (plan decoding, forward, sampling).", model)


def _one(kind: type, name: str, documentation: str, model: str, value: float) -> Metric:
    """A gauge or counter family of one sample, labelled with the model's name."""
    family = kind(f"{PREFIX}{name}", documentation, labels=["model_name"])
    family.add_metric([model], value)
    return family


def registry_for(engine: Engine, secondaries: Secondaries | None = None) -> CollectorRegistry:
    """A registry of this engine's metrics (and its secondary frontends'), not the process-wide default one."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, secondaries))
    return registry


def metrics_app(registry: CollectorRegistry):
    """A WSGI app serving registry's metrics in the text format 0.0.4 at any path: only the families
    that ``name[]`` query parameters name, when there are some, and gzipped for a scrape that accepts
    it (as Prometheus's do)."""

    def app(environ, start_response):
        names = parse_qs(environ.get("QUERY_STRING", "")).get("name[]")
        body = generate_latest(_Only(registry, set(names)) if names else registry)
        headers = [("Content-Type", CONTENT_TYPE), ("Vary", "Accept-Encoding")]
        if _accepts_gzip(environ.get("HTTP_ACCEPT_ENCODING", "")):
            body = gzip.compress(body, compresslevel=1)
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers + [("Content-Length", str(len(body)))])
        return [body] if environ.get("REQUEST_METHOD") != "HEAD" else [b""]

    return app


class _Only:
    """The families of registry that names name, by family or sample name (a histogram by its name, or
    its _bucket, _sum or _count samples), with only the samples named unless the family is."""

    def __init__(self, registry: CollectorRegistry, names: set[str]):
        self.registry, self.names = registry, names

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            samples = family.samples if family.name in self.names else [
                s for s in family.samples if s.name in self.names]
            if samples:
                kept = Metric(family.name, family.documentation, family.type, family.unit)
                kept.samples = samples
                yield kept


def _accepts_gzip(accept_encoding: str) -> bool:
    for part in accept_encoding.split(","):
        coding, _, params = part.partition(";")
        if coding.strip().lower() == "gzip":
            return params.replace(" ", "").lower() not in ("q=0", "q=0.0", "q=0.00", "q=0.000")
    return False


def require_api_key(app, api_key: str):
    """app, answering 401 to a request without 'Authorization: Bearer <api_key>'."""
    expected = f"Bearer {api_key}".encode()

    def guarded(environ, start_response):
        sent = environ.get("HTTP_AUTHORIZATION", "").encode()
        if hmac.compare_digest(sent, expected):  # constant-time comparison
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
        return [b"missing or wrong API key: send 'Authorization: Bearer <key>'\n"]

    return guarded


MAX_SCRAPES = 8  # connections served at once; the next wait for one of them to end
SCRAPE_TIMEOUT = 10.0  # seconds a connection has to send its whole request (and one waits for a turn)
LISTEN_BACKLOG = 128  # connections the kernel queues for the server to accept
MAX_REQUEST_HEAD = 16 << 10  # bytes of a request's line and headers


class _QuietHandler(WSGIRequestHandler):
    timeout = SCRAPE_TIMEOUT  # for each write of the answer

    def handle(self) -> None:
        """Reads the request's line and headers within SCRAPE_TIMEOUT in all (a client that sends them a
        byte at a time cannot hold its thread longer), then answers it."""
        head, deadline = b"", time.monotonic() + SCRAPE_TIMEOUT
        while b"\r\n\r\n" not in head:
            left = deadline - time.monotonic()
            if left <= 0 or len(head) > MAX_REQUEST_HEAD:
                return
            self.connection.settimeout(left)
            chunk = self.connection.recv(4096)
            if not chunk:
                return
            head += chunk
        self.rfile.close()
        self.rfile = io.BytesIO(head)  # a scrape is a GET: its head is all of it
        self.connection.settimeout(self.timeout)
        super().handle()

    def log_message(self, format, *args) -> None:  # noqa: A002 -- no line on stderr per scrape
        pass


class _MetricsServer(ThreadingMixIn, WSGIServer):
    """A thread a connection, at most MAX_SCRAPES of them: a flood of connections costs no more
    threads than that, and a scrape waits its turn behind them (each ends within SCRAPE_TIMEOUT).
    Connections that come while every slot is taken wait in the listen queue, which holds
    LISTEN_BACKLOG of them (socketserver's 5 would drop the SYNs past it: a one-second retry each)."""
    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, *args, **kwargs) -> None:
        self.slots = threading.BoundedSemaphore(MAX_SCRAPES)
        super().__init__(*args, **kwargs)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6 and self.server_address[0] == "::":  # and IPv4, as gRPC's [::]
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()

    def process_request(self, request, client_address) -> None:
        if self.slots.acquire(timeout=SCRAPE_TIMEOUT):
            super().process_request(request, client_address)
        else:
            self.shutdown_request(request)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a connection that timed out or went away: no traceback
            super().handle_error(request, client_address)


def serve_metrics(registry: CollectorRegistry, host: str, port: int, api_key: str | None = None) -> WSGIServer:
    """Serves registry over HTTP (/metrics) on its own daemon thread; port 0 lets the OS choose.
    With api_key, a scrape must send it as a bearer token."""
    app = metrics_app(registry)
    if api_key:
        app = require_api_key(app, api_key)
    host = every_address(host)
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        server_class = type("MetricsServer", (_MetricsServer,), {"address_family": family})
        server = make_server(host, port, app, server_class, handler_class=_QuietHandler)
    except OSError as exc:
        raise OSError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
    threading.Thread(target=server.serve_forever, daemon=True, name="twinplane-metrics").start()
    return server
