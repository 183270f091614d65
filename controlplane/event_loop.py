"""Runs the control plane's processes on uvloop when it is installed, else on asyncio's own loop;
keeps what a process holds for good out of its garbage collector's way; and, with DEBUG logging,
logs what stalls a process (long collections, a held event loop)."""

from __future__ import annotations

import asyncio
import atexit
import gc
import logging
import sys
import threading
import time
import traceback

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
    died meanwhile. With DEBUG logging on, each later collection of 1 ms or more is logged, and so is
    where the process's event loop (if it runs on one) was held for 5 ms or more.
    """
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)  # so the last collection at exit frees them (extensions check for leaks)
    log.debug("%s: %d objects kept since start-up are out of the garbage collector's reach",
              process, gc.get_freeze_count())
    if log.isEnabledFor(logging.DEBUG):
        if not any(isinstance(cb, _PauseLog) for cb in gc.callbacks):
            gc.callbacks.append(_PauseLog(process))
        _watch_loop(process)


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


_WATCHED: set[int] = set()  # the event loops that have a watcher


def _watch_loop(process: str, threshold_s: float = 0.005) -> None:
    """Starts a thread that logs where the event loop's thread is whenever the loop has run none of
    its callbacks for threshold_s (every stream of the process waits meanwhile); nothing without a
    running loop (the data plane)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    if id(loop) in _WATCHED:
        return
    _WATCHED.add(id(loop))
    last_beat = [time.monotonic()]

    def beat() -> None:
        last_beat[0] = time.monotonic()
        loop.call_later(threshold_s / 4, beat)

    def watch(loop_thread: int) -> None:
        reported = None
        while not loop.is_closed():
            time.sleep(threshold_s / 4)
            began = last_beat[0]
            held = time.monotonic() - began
            if held >= threshold_s and began != reported:
                reported = began
                frame = sys._current_frames().get(loop_thread)
                where = "".join(traceback.format_stack(frame, limit=8)) if frame is not None else "(unknown)\n"
                log.debug("%s: event loop held for %.1f ms so far, at:\n%s", process, held * 1e3, where.rstrip())

    beat()
    threading.Thread(target=watch, args=(threading.get_ident(),), name=f"{process}: loop watcher", daemon=True).start()
