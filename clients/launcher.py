"""Starts the data plane as a child process and restarts it if it dies."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import tempfile
import time

from twinplane.controlplane.liveness import Backoff

log = logging.getLogger("twinplane")


def gpu_groups(data_parallel_size: int, tensor_parallel_size: int, visible: str | None) -> list[str]:
    """CUDA_VISIBLE_DEVICES for each of data_parallel_size data planes of tensor_parallel_size GPUs each,
    taken in order from visible (the parent's CUDA_VISIBLE_DEVICES; unset: GPUs 0, 1, ...)."""
    needed = data_parallel_size * tensor_parallel_size
    devices = visible.split(",") if visible else [str(i) for i in range(needed)]
    if len(devices) < needed:
        raise ValueError(f"{data_parallel_size} data planes of {tensor_parallel_size} GPUs need {needed} GPUs; "
                         f"CUDA_VISIBLE_DEVICES lists {len(devices)}")
    return [",".join(devices[i * tensor_parallel_size:(i + 1) * tensor_parallel_size])
            for i in range(data_parallel_size)]


def private_socket_address() -> str:
    """A unix socket in a fresh private folder, for a data plane only its parent uses."""
    folder = tempfile.mkdtemp(prefix="twinplane-")
    return f"unix://{os.path.join(folder, 'dataplane.sock')}"


class DataPlaneProcess:
    def __init__(self, args: list[str], restart: bool = True, log_level: str = "INFO",
                 env: dict[str, str] | None = None):
        self.command = [sys.executable, "-m", "twinplane.clients.cli", "--log-level", log_level, "dataplane", *args]
        self.env = {**os.environ, **env} if env else None  # e.g. the GPUs this data plane may use
        self.restart = restart
        self.process: subprocess.Popen | None = None
        self._watch: asyncio.Task | None = None
        self.restarts = 0

    def start(self) -> None:
        self.started = time.monotonic()
        self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, env=self.env)

    async def watch(self) -> None:
        """Restarts the child whenever it exits, until stop(); backs off while it keeps failing."""
        backoff = Backoff()
        while True:
            code = await asyncio.to_thread(self.process.wait)
            if not self.restart:
                return
            delay = backoff.delay(time.monotonic() - self.started)
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
