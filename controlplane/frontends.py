"""Several frontend processes on one listening port, all driving one engine core (``--api-server-count``).

One frontend process (gRPC server, HTTP API, tokenizing, detokenizing, stop strings, streaming)
spends most of its time in gRPC's per-message work, so one process caps how many tokens a second
the control plane streams. With ``api_server_count`` N, the primary frontend (index 0, the one
``twinplane controlplane`` runs) starts N-1 secondary frontends, processes of their own with the
same configuration, which bind the same TCP ports with SO_REUSEPORT: the kernel spreads client
connections over them.

The primary runs the engine core's supervisor (``supervisor.py``). At each core start it makes
one socketpair per frontend, gives the core their core ends, and hands each secondary its end over
that secondary's control socket (a SOCK_SEQPACKET socketpair, file descriptors passed with
SCM_RIGHTS), so nothing listens on a path or name another local user could reach. Each frontend
numbers its sequences apart from the others' (``fanout.py``); the core sends each one its own
tokens and everyone the rest. A core that dies closes every frontend's channel: each secondary
keeps its requests and replays them to the next core, as the primary does.

Over its control socket a secondary also reports its request metrics every HEARTBEAT_INTERVAL
(the primary's /metrics sums them) and gets told to stop (SIGTERM on the primary drains every
frontend; a signal sent to the whole process group reaches the primary that way, the secondaries
ignore it). A secondary that exits stops the whole control plane (drained, non-zero exit), for
whatever runs it to restart; the primary going away stops every secondary.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
from dataclasses import replace

from twinplane.controlplane import event_loop
from twinplane.controlplane.config import ControlPlaneConfig
from twinplane.controlplane.ipc import Control, child_argv, start_process
from twinplane.controlplane.liveness import ticks
from twinplane.controlplane.messages import FrontendMetrics, NewCore, StartFrontend, StopFrontend
from twinplane.controlplane.metrics import EngineMetrics
from twinplane.controlplane.supervisor import wait_exit

log = logging.getLogger("twinplane.controlplane")
STOP_MARGIN = 10.0  # seconds a secondary gets past the shutdown grace to exit before it is killed


class Secondaries:
    """The primary's side of the secondary frontends: starts them, hands each its channel to every
    new engine core, keeps their latest metrics, and stops them."""

    def __init__(self, config: ControlPlaneConfig, security):
        self.config = config
        self.security = security
        self.processes: list[subprocess.Popen] = []
        self.controls: list[Control] = []
        self.metrics: dict[int, EngineMetrics] = {}  # the latest each secondary reported, by index
        self.died = asyncio.Event()  # a secondary exited while the control plane was not stopping
        self.why = ""  # which one, and how
        self.stopping = False
        self._tasks: list[asyncio.Task] = []

    def start(self, config: ControlPlaneConfig) -> None:
        """Starts frontends 1..N-1 with config (the primary's, with the ports it bound)."""
        for index in range(1, self.config.api_server_count):
            process, control = _start_secondary()
            control.start_reading()
            control.send(StartFrontend(config, self.security, index))
            self.processes.append(process)
            self.controls.append(control)
            self._tasks.append(asyncio.create_task(self._listen(index, process, control)))

    def hand_over(self, ends: list[socket.socket]) -> None:
        """Gives each secondary its end of a new core's channel (SCM_RIGHTS), then closes it here."""
        for control, end in zip(self.controls, ends):
            with end:
                control.send(NewCore(), [end.fileno()])

    async def _listen(self, index: int, process: subprocess.Popen, control: Control) -> None:
        while (item := await control.inbox.get()) is not None:
            message, _ = item
            assert isinstance(message, FrontendMetrics), f"unexpected message from frontend {index}: {message!r}"
            self.metrics[index] = message.metrics
        if not self.stopping:
            code = await asyncio.to_thread(wait_exit, process, 5.0)
            self.why = f"frontend {index} (pid {process.pid}) exited (code {code})"
            log.error("the control plane stops: %s", self.why)
            self.died.set()

    def tell_stop(self, grace: float) -> None:
        """Each secondary stops accepting requests and gives its streams grace seconds."""
        self.stopping = True
        for control in self.controls:
            control.send(StopFrontend(grace))

    async def wait_stopped(self, grace: float) -> None:
        """Waits for every secondary to exit (after tell_stop); kills those that take too long."""
        for process in self.processes:
            if await asyncio.to_thread(wait_exit, process, grace + STOP_MARGIN) is None:
                log.warning("frontend pid %d did not stop; killing it", process.pid)
                process.kill()
                await asyncio.to_thread(process.wait)
        for task in self._tasks:
            task.cancel()
        for control in self.controls:
            control.close()


def shared_config(config: ControlPlaneConfig, port: int, http_port: int | None) -> ControlPlaneConfig:
    """The secondaries' configuration: the ports the primary bound (port 0 resolved), no /metrics."""
    host = config.listen.rpartition(":")[0]
    http_listen = None
    if config.http_listen is not None:
        http_host, sep, _ = config.http_listen.rpartition(":")
        http_listen = f"{http_host}:{http_port}" if sep else str(http_port)
    return replace(config, listen=f"{host}:{port}", http_listen=http_listen, metrics_port=None)


def _start_secondary() -> tuple[subprocess.Popen, Control]:
    """A secondary frontend process and the primary's end of its control socket (Ctrl-C reaches
    the whole process group: the primary stops its secondaries in order)."""
    primary_end, secondary_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with secondary_end:
        process = start_process(__name__, [str(secondary_end.fileno())], [secondary_end.fileno()])
    return process, Control(primary_end)


# ---- a secondary frontend's process ---------------------------------------------------------


def main() -> None:
    """A secondary frontend's process: ``main()`` with argv [control socket fd, log level]."""
    (fd,), _ = child_argv()
    event_loop.run(_serve_secondary(socket.socket(fileno=int(fd))))


async def _serve_secondary(sock: socket.socket) -> None:
    """Serves until the primary says stop (or goes away); signals to the process group are ignored."""
    from twinplane.controlplane.main import ControlPlane, freeze_heap_once_ready
    from twinplane.controlplane.supervisor import CoreLink

    control = Control(sock)
    control.start_reading()
    first = await control.inbox.get()
    if first is None:
        return
    start, _ = first
    assert isinstance(start, StartFrontend), f"a secondary frontend's first message must be StartFrontend: {start!r}"
    config, index = start.config, start.index
    cores: asyncio.Queue = asyncio.Queue()
    plane = ControlPlane(config, start.security, index=index, link=lambda c, engine: CoreLink(c, engine, cores))
    await plane.start()
    frozen = asyncio.create_task(freeze_heap_once_ready(plane.engine, f"frontend {index}"))
    log.info("frontend %d serving on %s", index, config.listen)
    stop: asyncio.Future = asyncio.get_running_loop().create_future()
    report = asyncio.create_task(_report_metrics(control, plane.engine))
    commands = asyncio.create_task(_follow(control, cores, stop))
    await asyncio.wait((stop, asyncio.ensure_future(plane.engine.crashed.wait())),
                       return_when=asyncio.FIRST_COMPLETED)
    frozen.cancel()
    grace = stop.result() if stop.done() else 0.0
    await plane.shutdown(grace)
    report.cancel()
    commands.cancel()
    control.close()


async def _follow(control: Control, cores: asyncio.Queue, stop: asyncio.Future) -> None:
    """Applies the primary's messages: a new core's channel, or stop (grace); its going away stops too."""
    while (item := await control.inbox.get()) is not None:
        match item:
            case NewCore(), [fd]:
                cores.put_nowait(socket.socket(fileno=fd))
            case StopFrontend(grace), _:
                if not stop.done():
                    stop.set_result(grace)
            case _:
                raise AssertionError(f"unexpected message from the primary frontend: {item!r}")
    if not stop.done():
        log.error("the primary frontend is gone; stopping")
        stop.set_result(0.0)


async def _report_metrics(control: Control, engine) -> None:
    async for _ in ticks():
        control.send(FrontendMetrics(engine.metrics))
