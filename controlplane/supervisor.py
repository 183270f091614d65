"""Keeps the control plane's engine core running: starts it, watches its heartbeat, restarts it.

The core sends every frontend a heartbeat every ``HEARTBEAT_INTERVAL`` seconds, busy or idle. A
core silent for ``stall_timeout`` is reported hung (health NOT_SERVING) until it speaks again; one
silent for ``core_timeout`` is killed. A core that exits or is killed is started again, after a
delay that grows while it keeps dying soon after starting; the new core reconnects to the same
data plane. The primary frontend runs the CoreSupervisor; the others (``frontends.py``) each run a
CoreLink, which gets its channel to every new core from the primary.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import time
from collections.abc import Callable

from twinplane.controlplane.config import ControlPlaneConfig
from twinplane.controlplane.engine_core import start_core_process
from twinplane.controlplane.ipc import Channel
from twinplane.controlplane.liveness import Backoff, Silence, ticks
from twinplane.controlplane.messages import Configure, CoreMessage, Shutdown

log = logging.getLogger("twinplane.controlplane")
CORE_STOP_TIMEOUT = 5.0  # seconds the engine core gets to exit before it is killed


class _Link:
    """A frontend's link to the running engine core: its channel, and whether the core is hung.

    The frontend has ``receive(message)`` (messages.FrontendMessage), ``core_snapshot`` (carried on
    to a new core), ``core_hung(bool)`` and ``core_died()``.
    """

    def __init__(self, config: ControlPlaneConfig, frontend):
        self.config = config
        self.frontend = frontend
        self.channel: Channel | None = None  # to the running core
        self.hung = False
        self.stopped = False

    def send(self, message: CoreMessage) -> None:
        """Sends message to the running core; dropped while there is none."""
        if self.channel is not None:
            self.channel.send(message)

    def _attach(self, sock: socket.socket) -> Channel:
        """The channel to a new core, on this frontend's end of their socketpair."""
        self.channel = Channel(sock)
        return self.channel

    async def _serve(self, channel: Channel, kill: Callable[[], None] | None = None) -> None:
        """Applies the core's messages until its end of the channel closes; kill: what ends a core
        silent for core_timeout (None: the primary frontend's supervisor does)."""
        watchdog = asyncio.create_task(self._watch(channel, kill))
        try:
            await channel.serve(self.frontend.receive, turn_each=True)  # streams keep up with a backlog
        finally:
            watchdog.cancel()
            channel.close()

    async def _watch(self, channel: Channel, kill: Callable[[], None] | None) -> None:
        """Counts the core's silence (from its first message on: before that it is still starting)."""
        silence, seen = Silence(), 0
        async for elapsed in ticks():
            heard = channel.num_received != seen or not seen
            seen = channel.num_received
            silent = silence.tick(heard, elapsed)
            self._set_hung(silent >= self.config.stall_timeout)
            if kill is not None and silent >= self.config.core_timeout:
                log.error("the engine core has not answered for %.1f s; killing it", silent)
                kill()
                return

    def _gone(self) -> None:
        """The core exited or was killed: the next one starts unhung (the frontend forgets the stall)."""
        self.hung = False
        self.frontend.core_died()

    def _set_hung(self, hung: bool) -> None:
        if hung != self.hung:
            self.hung = hung
            if hung:
                log.warning("the engine core has not answered for %.1f s; reporting NOT_SERVING",
                            self.config.stall_timeout)
            else:
                log.warning("the engine core answers again")
            self.frontend.core_hung(hung)


class CoreSupervisor(_Link):
    """Runs one engine core process at a time, for the primary frontend (and the others)."""

    def __init__(self, config: ControlPlaneConfig, frontend):
        super().__init__(config, frontend)
        self.process: subprocess.Popen | None = None
        # gives the other frontends their ends of a new core's channels (frontends.Secondaries.hand_over)
        self.hand_over: Callable[[list[socket.socket]], None] | None = None

    async def run(self) -> None:
        """Runs the core, and a new one each time it dies, until stop(); raises what handling a message raised."""
        backoff = Backoff()
        while not self.stopped:
            started = time.monotonic()
            await self._run_once()
            if self.stopped:
                return
            code = await asyncio.to_thread(wait_exit, self.process, CORE_STOP_TIMEOUT)
            delay = backoff.delay(time.monotonic() - started)
            log.error("the engine core exited (code %s); starting a new one in %.1f s", code, delay)
            self._gone()
            await asyncio.sleep(delay)

    async def _run_once(self) -> None:
        """Starts a core and serves its messages until its end of the channel closes."""
        self.process, sock, others = start_core_process(self.config)
        if others:
            self.hand_over(others)
        channel = self._attach(sock)
        await channel.open()
        channel.send(Configure(self.config, self.frontend.core_snapshot))
        await self._serve(channel, self.process.kill)

    async def stop(self) -> None:
        """Asks the core to shut down, and kills it if it does not within CORE_STOP_TIMEOUT."""
        self.stopped = True
        process = self.process
        if process is None:
            return
        self.send(Shutdown())
        if await asyncio.to_thread(wait_exit, process, CORE_STOP_TIMEOUT) is None:
            log.warning("the engine core did not stop in %.0f s; killing it", CORE_STOP_TIMEOUT)
            process.kill()
            await asyncio.to_thread(process.wait)
        self.channel.close()


class CoreLink(_Link):
    """A secondary frontend's link: its end of each new core's channel comes from the primary."""

    def __init__(self, config: ControlPlaneConfig, frontend, channels: asyncio.Queue):
        super().__init__(config, frontend)
        self.channels = channels  # sockets, as the primary hands them over; None: no more

    async def run(self) -> None:
        """Serves each core in turn until stop(); the requests in flight go on to the next one."""
        while (sock := await self.channels.get()) is not None:
            channel = self._attach(sock)
            await channel.open()
            await self._serve(channel)
            if self.stopped:
                return
            log.error("the engine core is gone; waiting for the next one")
            self._gone()

    async def stop(self) -> None:
        self.stopped = True
        if self.channel is not None:
            self.channel.close()
        self.channels.put_nowait(None)


def wait_exit(process: subprocess.Popen, timeout: float) -> int | None:
    """The process's exit code once it exits within timeout seconds, else None."""
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        return None
