"""Starts the data plane as a child process and restarts it if it dies."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

log = logging.getLogger("twinplane")
STABLE_SECONDS = 60.0  # a child that ran this long before exiting resets the back-off
TOKEN_ENV = "TWINPLANE_DATAPLANE_TOKEN"


def restart_delay(quick_exits: int) -> float:
    """Seconds to wait before a restart after `quick_exits` exits in a row that came soon after a
    start: 0.5 s, doubling up to 30 s, so a data plane that cannot start does not spin."""
    return min(0.5 * 2 ** max(quick_exits - 1, 0), 30.0)


def new_token() -> str:
    """A random data-plane token (256 bits)."""
    return secrets.token_urlsafe(32)


class DataPlaneProcess:
    """The data plane as a child process, listening on address (default: a unix socket in a fresh
    private folder, removed by stop()). The token reaches the child through its environment, never
    its command line, which any local user can read."""

    def __init__(self, args: list[str], restart: bool = True, log_level: str = "INFO", *,
                 address: str | None = None, token: str | None = None):
        self._folder = None if address else tempfile.mkdtemp(prefix="twinplane-")  # mode 0700
        self.address = address or f"unix://{os.path.join(self._folder, 'dataplane.sock')}"
        self.command = [sys.executable, "-m", "twinplane.clients.cli", "--log-level", log_level, "dataplane", *args,
                        "--listen", self.address]
        self.env = {**os.environ, TOKEN_ENV: token} if token else None
        self.restart = restart
        self.process: subprocess.Popen | None = None
        self._watch: asyncio.Task | None = None
        self.restarts = 0

    def start(self) -> None:
        self.started = time.monotonic()
        self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, env=self.env)

    async def watch(self) -> None:
        """Restarts the child whenever it exits, until stop(); backs off while it keeps failing."""
        quick_exits = 0
        while True:
            code = await asyncio.to_thread(self.process.wait)
            if not self.restart:
                return
            quick_exits = quick_exits + 1 if time.monotonic() - self.started < STABLE_SECONDS else 0
            delay = restart_delay(quick_exits)
            self.restarts += 1
            log.warning("data plane exited with %s; restarting it in %.1f s (restart %d)", code, delay, self.restarts)
            await asyncio.sleep(delay)
            if not self.restart:
                return
            self.start()

    def start_watching(self) -> None:
        self._watch = asyncio.get_running_loop().create_task(self.watch())

    def stop(self, timeout: float = 10.0) -> None:
        self.restart = False
        if self._watch is not None:
            self._watch.cancel()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
