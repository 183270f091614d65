"""Runs the control plane's processes on uvloop when it is installed, else on asyncio's own loop;
and keeps what a process holds for good out of its garbage collector's way."""

from __future__ import annotations

import asyncio
import atexit
import gc
import logging
import time

log = logging.getLogger("twinplane.controlplane")


def run(coro):
    """Runs coro to completion on a new event loop; returns its result."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def freeze_heap(process: str) -> None:
    """Moves every object alive now out of the cyclic garbage collector's reach (``gc.freeze``).

    Called once a process holds what it keeps for good (imported modules, the tokenizer, a data
    plane's model and CUDA graphs). Otherwise a full collection walks hundreds of thousands of
    those objects and stalls every stream for tens to hundreds of milliseconds; after it,
    collections walk only what serving allocated. A later call first lets the collector free what
    died meanwhile. With DEBUG logging on, each later collection of 1 ms or more is logged.
    """
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)  # so the last collection at exit frees them (extensions check for leaks)
    log.debug("%s: %d objects kept since start-up are out of the garbage collector's reach",
              process, gc.get_freeze_count())
    if log.isEnabledFor(logging.DEBUG) and not any(isinstance(cb, _PauseLog) for cb in gc.callbacks):
        gc.callbacks.append(_PauseLog(process))


class _PauseLog:
    """A gc callback that logs collections of 1 ms or more (the streams stall for that long)."""

    def __init__(self, process: str) -> None:
        self.process, self.started = process, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        ms = (time.perf_counter() - self.started) * 1e3
        if ms >= 1.0:
            log.debug("%s: garbage collection of generation %d took %.1f ms (%d objects freed)",
                      self.process, info["generation"], ms, info["collected"])
