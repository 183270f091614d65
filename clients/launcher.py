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

from twinplane.controlplane.ipc import CONFIG_ERROR_EXIT, SUPERVISED_ENV, popen_shielded
from twinplane.controlplane.liveness import Backoff

log = logging.getLogger("twinplane")
TOKEN_ENV = "TWINPLANE_DATAPLANE_TOKEN"


def gpu_groups(data_parallel_size: int, tensor_parallel_size: int, visible: str | None,
               available: int | None = None) -> list[str]:
    """CUDA_VISIBLE_DEVICES for each of data_parallel_size data planes of tensor_parallel_size GPUs each,
    taken in order from visible (the parent's CUDA_VISIBLE_DEVICES; unset: GPUs 0, 1, ... of the
    host's ``available``, when known)."""
    needed = data_parallel_size * tensor_parallel_size
    if not visible and available is not None and available < needed:  # a data plane would get no GPU
        raise ValueError(f"{data_parallel_size} data planes of {tensor_parallel_size} GPUs need {needed} GPUs; "
                         f"this host has {available}")
    devices = visible.split(",") if visible else [str(i) for i in range(needed)]
    if len(devices) < needed:
        raise ValueError(f"{data_parallel_size} data planes of {tensor_parallel_size} GPUs need {needed} GPUs; "
                         f"CUDA_VISIBLE_DEVICES lists {len(devices)}")
    return [",".join(devices[i * tensor_parallel_size:(i + 1) * tensor_parallel_size])
            for i in range(data_parallel_size)]


def new_token() -> str:
    """A random data-plane token (256 bits)."""
    return secrets.token_urlsafe(32)


class DataPlaneProcess:
    """The data plane as a child process, listening on address (default: a unix socket in a fresh
    private folder, removed by stop()). The token reaches the child through its environment, never
    its command line, which any local user can read; env adds to its environment (e.g. its GPUs)."""

    def __init__(self, args: list[str], restart: bool = True, log_level: str = "INFO", *,
                 address: str | None = None, token: str | None = None, env: dict[str, str] | None = None):
        self._folder = None if address else tempfile.mkdtemp(prefix="twinplane-")  # mode 0700
        self.address = address or f"unix://{os.path.join(self._folder, 'dataplane.sock')}"
        self.command = [sys.executable, "-m", "twinplane.clients.cli", "--log-level", log_level, "dataplane", *args,
                        f"--listen={self.address}"]
        self.env = {**os.environ, **(env or {}), **({TOKEN_ENV: token} if token else {}), SUPERVISED_ENV: "1"}
        self.restart = restart
        self.process: subprocess.Popen | None = None
        self._watch: asyncio.Task | None = None
        self.restarts = 0
        self.refused: asyncio.Event | None = None  # set when the child exits with CONFIG_ERROR_EXIT

    def start(self) -> None:
        self.started = time.monotonic()
        # its stdin stays open until stop() (or this process's end) closes it: that stops it; it
        # ignores signals to the process group, which would stop it while this process drains
        self.process = popen_shielded(self.command, stdin=subprocess.PIPE, env=self.env)

    async def watch(self) -> None:
        """Restarts the child whenever it exits, until stop(); backs off while it keeps failing.
        A child that refused its configuration is not restarted: ``refused`` is set instead."""
        backoff = Backoff()
        while True:
            code = await asyncio.to_thread(self.process.wait)
            if not self.restart:
                return
            if code == CONFIG_ERROR_EXIT:
                log.error("the data plane refused its configuration (its error is above); not restarting it")
                if self.refused is not None:
                    self.refused.set()
                return
            delay = backoff.delay(time.monotonic() - self.started)
            self.restarts += 1
            log.warning("data plane exited with %s; restarting it in %.1f s (restart %d)", code, delay, self.restarts)
            await asyncio.sleep(delay)
            if not self.restart:
                return
            self.process.stdin.close()
            self.start()

    def start_watching(self, refused: asyncio.Event | None = None) -> None:
        """Watches the child in the running loop; ``refused`` is set if it refuses its configuration."""
        self.refused = refused
        self._watch = asyncio.get_running_loop().create_task(self.watch())

    def stop(self, timeout: float = 10.0) -> None:
        self.restart = False
        if self._watch is not None:
            self._watch.cancel()
        if self.process is not None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
