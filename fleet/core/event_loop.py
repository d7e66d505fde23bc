"""The event loop the long-running services (`kvfleet controller`, `kvfleet proxy`) run on.

uvloop (libuv) where it is installed, a core dependency outside Windows: the controller and the proxy spend most
of their request-path CPU in the loop's own machinery (callbacks, socket reads and writes, timers), which uvloop
runs in C. KVFLEET_EVENT_LOOP=asyncio runs asyncio's own loop instead (to compare, or to rule the loop out).
Measured in bench/proxy_load.py (docs/proxy.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("kvfleet")


def loop_name() -> str:
    """"uvloop" or "asyncio": the loop `run` would use."""
    if os.environ.get("KVFLEET_EVENT_LOOP", "uvloop") == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on the loop `loop_name` names."""
    name = loop_name()
    log.info("event loop: %s", name)
    if name == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
