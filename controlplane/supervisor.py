"""Keeps the control plane's engine core running: starts it, watches its heartbeat, restarts it.

The core sends a heartbeat every ``HEARTBEAT_INTERVAL`` seconds, busy or idle. A core silent for
``stall_timeout`` is reported hung (health NOT_SERVING) until it speaks again; one silent for
``core_timeout`` is killed. A core that exits or is killed is started again, after a delay that
grows while it keeps dying soon after starting; the new core reconnects to the same data plane.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time

from twinplane.controlplane.config import ControlPlaneConfig
from twinplane.controlplane.engine_core import CORE_CALLS, FRONTEND_CALLS, start_core_process
from twinplane.controlplane.ipc import Channel, Remote
from twinplane.controlplane.liveness import Backoff, Silence, ticks

log = logging.getLogger("twinplane.controlplane")
CORE_STOP_TIMEOUT = 5.0  # seconds the engine core gets to exit before it is killed


class CoreSupervisor:
    """Runs one engine core process at a time for a frontend.

    The frontend serves FRONTEND_CALLS and has ``core_snapshot`` (carried on to a new core),
    ``core_hung(bool)`` and ``core_died()``.
    """

    def __init__(self, config: ControlPlaneConfig, frontend):
        self.config = config
        self.frontend = frontend
        self.core: Remote | None = None  # CORE_CALLS on the running core
        self.process: subprocess.Popen | None = None
        self.channel: Channel | None = None
        self.hung = False
        self.stopped = False

    async def run(self) -> None:
        """Runs the core, and a new one each time it dies, until stop(); raises what a frontend call raised."""
        backoff = Backoff()
        while not self.stopped:
            started = time.monotonic()
            await self._run_once()
            if self.stopped:
                return
            code = await asyncio.to_thread(_wait, self.process, CORE_STOP_TIMEOUT)
            delay = backoff.delay(time.monotonic() - started)
            log.error("the engine core exited (code %s); starting a new one in %.1f s", code, delay)
            self._set_hung(False)
            self.frontend.core_died()
            await asyncio.sleep(delay)

    async def _run_once(self) -> None:
        """Starts a core and serves its calls until its end of the channel closes."""
        self.process, self.channel = start_core_process(self.config)
        self.core = Remote(self.channel, CORE_CALLS)
        await self.channel.open()
        self.channel.call("configure", self.config, self.frontend.core_snapshot)
        watchdog = asyncio.create_task(self._watch(self.process, self.channel))
        try:
            await self.channel.serve(self.frontend, FRONTEND_CALLS)
        finally:
            watchdog.cancel()
            self.channel.close()

    async def _watch(self, process: subprocess.Popen, channel: Channel) -> None:
        """Counts the core's silence (from its first call on: before that it is still starting)."""
        silence, seen = Silence(), 0
        async for elapsed in ticks():
            heard = channel.num_received != seen or not seen
            seen = channel.num_received
            silent = silence.tick(heard, elapsed)
            self._set_hung(silent >= self.config.stall_timeout)
            if silent >= self.config.core_timeout:
                log.error("the engine core has not answered for %.1f s; killing it", silent)
                process.kill()
                return

    def _set_hung(self, hung: bool) -> None:
        if hung != self.hung:
            self.hung = hung
            if hung:
                log.warning("the engine core has not answered for %.1f s; reporting NOT_SERVING",
                            self.config.stall_timeout)
            else:
                log.warning("the engine core answers again")
            self.frontend.core_hung(hung)

    async def stop(self) -> None:
        """Asks the core to shut down, and kills it if it does not within CORE_STOP_TIMEOUT."""
        self.stopped = True
        process = self.process
        if process is None:
            return
        self.core.shutdown()
        if await asyncio.to_thread(_wait, process, CORE_STOP_TIMEOUT) is None:
            log.warning("the engine core did not stop in %.0f s; killing it", CORE_STOP_TIMEOUT)
            process.kill()
            await asyncio.to_thread(process.wait)
        self.channel.close()


def _wait(process: subprocess.Popen, timeout: float) -> int | None:
    """The process's exit code once it exits within timeout seconds, else None."""
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        return None
