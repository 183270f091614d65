"""Runs the control plane's processes on uvloop when it is installed, else on asyncio's own loop."""

from __future__ import annotations

import asyncio


def run(coro):
    """Runs coro to completion on a new event loop; returns its result."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
