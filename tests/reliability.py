"""Helpers shared by the tests/test_reliability_*.py files (not a test module itself)."""

from __future__ import annotations

import asyncio
import re
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable

import grpc

from twinplane.clients.client import AsyncClient

GREEDY = dict(temperature=0, ignore_eos=True)
# Graceful-shutdown tests stream a short request that must end within the grace period and a long one that must
# not. The model is large enough that the long one cannot end in time on any machine: its 8,000 tokens read the
# weights (270 MB or more) 8,000 times, 20 s at 100 GB/s. A token takes ~45 ms on an idle 2-core machine and up
# to ~10 times that beside other work, so 8 tokens leave room. (With a tiny model, 4,000 tokens took 5-6 s on
# the 2-core machine: some outlasted 6 s of grace, some did not.)
DRAIN_SHAPE, DRAIN_ARGS = "dummy:smollm2-135m", ("--block-size", "16", "--max-model-len", "8192")
DRAIN_MODEL = ["--model", DRAIN_SHAPE, "--device", "cpu", *DRAIN_ARGS]
DRAIN_SHORT, DRAIN_LONG = 8, 8000


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, poll: float = 0.02) -> None:
    """Polls predicate until it holds; AssertionError naming what after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def stop_process(process: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
    """Sends sig to process unless it has exited, and waits for it. One that does not exit in timeout
    seconds is killed, so no test leaves a process behind, and the test fails (TimeoutExpired)."""
    if process.poll() is not None:
        return
    process.send_signal(sig)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise


class ProcessLog:
    """A child's stderr (opened as text), read on a thread of its own as the child writes it."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process, self.lines = process, []
        self.reader = threading.Thread(target=lambda: self.lines.extend(process.stderr), daemon=True)
        self.reader.start()

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """The first match of pattern, once the child has written it; AssertionError if it exits first."""
        wait_until(lambda: re.search(pattern, self.text) or self.process.poll() is not None, timeout,
                   f"stderr to match {pattern!r}", poll=0.1)
        match = re.search(pattern, self.text)
        assert match, f"the process exited ({self.process.poll()}) without {pattern!r}: {self.text[-2000:]}"
        return match

    def listening_address(self, timeout: float = 120) -> str:
        """Where a control plane started with --listen HOST:0 listens, from its start-up line."""
        return self.wait_for(r"control plane listening on (\S+?),", timeout).group(1)

    def rest(self, timeout: float = 30) -> str:
        """All of it, once the child has closed its stderr (exited)."""
        self.reader.join(timeout)
        return self.text


class StderrLog:
    """What the processes of a test have written to stderr (the engine core's log among it), read as it grows
    (from pytest's capfd)."""

    def __init__(self, capfd):
        self.capfd, self.text = capfd, ""

    def read(self) -> str:
        """What was written since the last read."""
        new = self.capfd.readouterr().err
        self.text += new
        return new

    def __contains__(self, needle: str) -> bool:
        self.read()
        return needle in self.text

    def wait_for(self, *needles: str, timeout: float = 30.0) -> str:
        """The log so far, once it holds every needle."""
        wait_until(lambda: all(needle in self for needle in needles), timeout, f"the log to say {needles}", poll=0.2)
        return self.text


def all_blocks_free(planes) -> bool:
    free, total = planes.free_blocks()
    return free == total and not planes.engine.requests


async def tokens_async(client: AsyncClient, prompt: list[int], **kwargs) -> list[int]:
    """Generates from token ids and returns every token of the stream."""
    return [t async for chunk in client.generate(token_ids=prompt, **kwargs) for t in chunk.token_ids]


async def greedy_references(address: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs of prompts run concurrently, undisturbed (batch invariance is tested elsewhere)."""
    async with AsyncClient(address) as client:
        return list(await asyncio.gather(*(tokens_async(client, p, max_tokens=max_tokens, **GREEDY)
                                           for p in prompts)))


async def running_streams(clients: list[AsyncClient], prompts: list[list[int]], max_tokens: int,
                          timeout: float = 240) -> tuple[list, list[int]]:
    """Starts a greedy stream per prompt, spread over clients; returns once each has 3 tokens: the
    streams (each resolving to its tokens) and the live count of tokens each has so far."""
    seen = [0] * len(prompts)

    async def one(i: int) -> list[int]:
        out = []
        async for chunk in clients[i % len(clients)].generate(token_ids=prompts[i], max_tokens=max_tokens,
                                                              timeout=timeout, **GREEDY):
            out += chunk.token_ids
            seen[i] = len(out)
        return out

    streams = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
    while min(seen) < 3:
        await asyncio.sleep(0.005)
    return streams, seen


def status_code(error: BaseException) -> grpc.StatusCode | None:
    return error.code() if isinstance(error, grpc.RpcError) else None


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def interrupt_mid_stream(command: list[str], planes) -> tuple[int, bytes, bytes]:
    """Runs a client command, sends it SIGINT once its text streams, and checks that the request's
    blocks are freed; returns its exit code, stdout and stderr."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL) as proc:
        try:
            assert select.select([proc.stdout], [], [], 60)[0], "no text streamed within 60 s"
            assert planes.engine.requests  # still generating
            proc.send_signal(signal.SIGINT)
            stdout, stderr = proc.communicate(timeout=30)
        finally:
            proc.kill()
    wait_until(lambda: all_blocks_free(planes), 10, "the cancelled request's blocks to be freed")
    return proc.returncode, stdout, stderr
