"""Waiting on what a test checks, not for a fixed time: on a loaded machine a fixed 0.1-2 s fell short again and again
(the controller reading a frame, looking at a worker, queueing a call)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def wait_until(cond: Callable[[], object], what: str, timeout_s: float = 10.0) -> None:
    """Until `cond()` holds, polled every 20 ms; past `timeout_s` (a bound on waiting, not a timing assertion) fail
    naming `what`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"still waiting for: {what}"
        await asyncio.sleep(0.02)
