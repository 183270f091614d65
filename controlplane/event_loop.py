"""Runs the control plane's processes on uvloop when it is installed, else on asyncio's own loop;
and keeps what a process holds for good out of its garbage collector's way."""

from __future__ import annotations

import asyncio
import atexit
import gc
import logging

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
    plane's KV blocks). Otherwise a full collection walks hundreds of thousands of those objects
    and stalls every stream for tens to hundreds of milliseconds; after it, collections walk only
    what serving allocated. A later call first lets the collector free what died meanwhile.
    """
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)  # so the last collection at exit frees them (extensions check for leaks)
    log.debug("%s: %d objects kept since start-up are out of the garbage collector's reach",
              process, gc.get_freeze_count())
