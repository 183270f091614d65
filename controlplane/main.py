"""Runs the control plane: public gRPC server + engine, with graceful shutdown; with
``api_server_count`` > 1, the other frontend processes too (``frontends.py``)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from twinplane.controlplane.auth import ApiKeyInterceptor
from twinplane.controlplane.config import ControlPlaneConfig
from twinplane.controlplane.engine import Engine, first_of
from twinplane.controlplane.event_loop import freeze_heap
from twinplane.controlplane.frontends import Secondaries, shared_config
from twinplane.controlplane.ipc import GROUP_SIGNALS, ConfigExit
from twinplane.controlplane.metrics import registry_for, serve_metrics
from twinplane.controlplane.server import create_server
from twinplane.controlplane.supervisor import CoreSupervisor
from twinplane.controlplane.tls import bound_address, server_credentials

log = logging.getLogger("twinplane.controlplane")

# Once the drain has ended the calls still running, their handlers send each status (up to
# STATUS_GRACE), and the servers stay up LINGER seconds more before they close their connections:
# a client still reading its last tokens when its connection closes loses the status with it
# ("Stream removed") instead of reading why its call ended.
STATUS_GRACE = 5.0
LINGER = 1.0


@dataclass(frozen=True)
class Security:
    tls_cert: str | None = None  # PEM files; both or neither
    tls_key: str | None = None
    api_key: str | None = None  # clients send "authorization: Bearer <key>"

    def credentials(self) -> grpc.ServerCredentials | None:
        return server_credentials(self.tls_cert, self.tls_key)


class ControlPlane:
    """A frontend's engine and its public servers, started and stopped together; the primary's
    (index 0) also starts and stops the other frontends."""

    def __init__(self, config: ControlPlaneConfig, security: Security = Security(), index: int = 0,
                 link=CoreSupervisor):
        self.config = config
        self.engine = Engine(config, index, link)
        self.secondaries = None
        if index == 0 and config.api_server_count > 1:
            self.secondaries = Secondaries(config, security)
        interceptors = [ApiKeyInterceptor(security.api_key)] if security.api_key else []
        self.server, self.port = create_server(self.engine, config.listen, max_message_bytes=config.max_message_bytes,
                                               credentials=security.credentials(), interceptors=interceptors,
                                               reuse_port=config.api_server_count > 1)
        self.metrics_registry = registry_for(self.engine, self.secondaries)
        self.metrics_key = security.api_key if config.metrics_api_key else None
        self.metrics_server = None  # the HTTP server of /metrics, once started
        self.http_server = None  # the OpenAI-compatible HTTP API, when config.http_listen is set
        if config.http_listen is not None:
            from twinplane.controlplane.openai_http import HttpServer

            self.http_server = HttpServer(self.engine, config.http_listen, security.api_key, config.max_message_bytes,
                                          security.tls_cert, security.tls_key,
                                          reuse_port=config.api_server_count > 1,
                                          client_timeout=config.http_client_timeout)
        self._start_task: asyncio.Task | None = None

    async def start(self) -> None:
        if self.config.metrics_port is not None:  # first: a port it cannot have stops nothing started yet
            host = self.config.metrics_host
            self.metrics_server = serve_metrics(self.metrics_registry, host, self.config.metrics_port,
                                                self.metrics_key)
            log.info("metrics on http://%s:%d/metrics%s", host, self.metrics_port,
                     " (API key required)" if self.metrics_key else "")
        await self.server.start()
        if self.secondaries is not None:  # they bind the ports this one bound
            self.secondaries.start(shared_config(self.config, self.port, self.http_port))
            self.engine.supervisor.hand_over = self.secondaries.hand_over
        if self.http_server is not None:
            await self.http_server.start()
            log.info("OpenAI-compatible HTTP API on %s:%d", self.http_server.host, self.http_server.port)
        # health says NOT_SERVING until the data plane is ready
        self._start_task = asyncio.create_task(self.engine.start())

    @property
    def address(self) -> str:
        """Where the gRPC API listens: --listen, with the port the OS chose for port 0."""
        return bound_address(self.config.listen, self.port)

    @property
    def http_port(self) -> int | None:
        """The port of the HTTP API (the one the OS chose for port 0), or None."""
        return self.http_server.port if self.http_server else None

    @property
    def metrics_port(self) -> int | None:
        """The port /metrics is served on (the one the OS chose for port 0), or None."""
        return self.metrics_server.server_port if self.metrics_server else None

    async def wait_ready(self, timeout: float | None = None) -> None:
        await asyncio.wait_for(self.engine.ready.wait(), timeout)

    async def shutdown(self, grace: float | None = None) -> None:
        """Drains every frontend for up to grace seconds, then stops the servers and the engine core."""
        grace = self.config.shutdown_grace if grace is None else grace
        if self.secondaries is not None:
            self.secondaries.tell_stop(grace)  # they drain meanwhile
        if self.engine.describe is None:  # none admitted yet: the calls waiting for a data plane end at once
            self.engine.stop_accepting()
            ended = 0
        else:
            ended = await self.engine.drain(grace)
        if self.secondaries is not None:
            await self.secondaries.wait_stopped(grace)  # before the core stops
        if ended:
            await self.engine.streams_closed(STATUS_GRACE)
            await asyncio.sleep(LINGER)
        if self.http_server is not None:
            await self.http_server.stop()
        await self.server.stop(STATUS_GRACE)
        if self._start_task is not None and not self._start_task.done():
            self._start_task.cancel()
        await self.engine.stop()
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.shutdown)
            self.metrics_server.server_close()


async def freeze_heap_once_ready(engine: Engine, process: str) -> None:
    """Once the frontend first serves (its tokenizer loaded), what it holds then is kept for good."""
    await engine.ready.wait()
    freeze_heap(process)


async def serve(config: ControlPlaneConfig, security: Security = Security(), on_readiness=None,
                dataplane_refused: asyncio.Event | None = None) -> None:
    """Serves until SIGTERM or SIGINT, then shuts down gracefully; on_readiness(ready, address) is
    called whenever the service becomes ready or stops being ready (address: ControlPlane.address).
    ``dataplane_refused`` (set by the launcher of a child data plane that refused its flags) stops
    it at once with that reason."""
    try:  # binds its ports: one that is taken, or not this host's, is a one-line error
        plane = ControlPlane(config, security)
        if on_readiness is not None:
            plane.engine.on_readiness.append(lambda ready: on_readiness(ready, plane.address))
        await plane.start()
    except OSError as exc:
        raise SystemExit(f"the control plane cannot start: {exc}") from None
    frozen = asyncio.create_task(freeze_heap_once_ready(plane.engine, "frontend 0"))
    log.info("control plane listening on %s, data plane %s%s", plane.address, config.dataplane,
             f", {config.api_server_count} frontend processes" if config.api_server_count > 1 else "")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in GROUP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    secondary_died = plane.secondaries.died if plane.secondaries is not None else asyncio.Event()
    refused = dataplane_refused if dataplane_refused is not None else asyncio.Event()
    await first_of(stop, plane.engine.crashed, secondary_died, refused)
    frozen.cancel()
    if refused.is_set():  # a bad model path or TP size: waiting would not bring the data plane up
        await plane.shutdown(grace=0.0)
        raise ConfigExit("the control plane stopped: its data plane refused its configuration (see the error above)")
    if plane.engine.crashed.is_set():  # e.g. an unreadable tokenizer folder: say so and exit, don't hang
        await plane.shutdown(grace=0.0)
        raise SystemExit("the control plane stopped: its engine failed (see the error above)")
    if secondary_died.is_set():  # whatever runs the control plane restarts it whole
        await plane.shutdown()
        raise SystemExit(f"the control plane stopped: {plane.secondaries.why}")
    log.info("shutting down: in-flight requests get %.1f s", config.shutdown_grace)
    await plane.shutdown()
