"""Liveness between the control plane's processes and the data plane: ticks, restarts, back-off."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

HEARTBEAT_INTERVAL = 0.5  # seconds between the engine core's heartbeats (and between checks)
STABLE_SECONDS = 60.0  # a process that ran this long before exiting resets the restart back-off


async def ticks(interval: float = HEARTBEAT_INTERVAL) -> AsyncIterator[float]:
    """Yields every interval seconds the time since the previous tick, at most two intervals: a tick
    that comes late because this process was stopped or starved never counts the time it lost
    against whatever it watches."""
    loop = asyncio.get_running_loop()
    last = loop.time()
    while True:
        await asyncio.sleep(interval)
        now = loop.time()
        yield min(now - last, 2 * interval)
        last = now


class Silence:
    """How long something has gone unheard, in the elapsed times of ticks(): counted from the first
    tick that heard nothing, so a late tick never blames it for time before it went quiet."""

    def __init__(self) -> None:
        self.seconds: float | None = None  # None: heard at the last tick

    def tick(self, heard: bool, elapsed: float) -> float:
        """Seconds of silence after a tick that heard (or did not hear) from it."""
        if heard:
            self.seconds = None
            return 0.0
        self.seconds = 0.0 if self.seconds is None else self.seconds + elapsed
        return self.seconds


class Backoff:
    """Delays between restarts of one process: 0.5 s, doubling up to 30 s while it keeps exiting
    soon after it started, so a process that cannot start does not spin."""

    def __init__(self) -> None:
        self.quick_exits = 0

    def delay(self, ran_for: float) -> float:
        """The delay before the next start of a process that exited after ran_for seconds."""
        self.quick_exits = self.quick_exits + 1 if ran_for < STABLE_SECONDS else 0
        return min(0.5 * 2 ** max(self.quick_exits - 1, 0), 30.0)
