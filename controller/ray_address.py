"""A Ray address checked before `ray.init` joins it.

NOTE: `ray.init(address=...)` with nothing at the address retries the GCS for minutes, printing only Ray's
own retry lines, and cannot be interrupted: `kvfleet up --ray-address 127.0.0.1:1` hung and ignored Ctrl-C, and
each session call of a controller started so blocked ~120 s. One TCP connect to the GCS host:port (bounded by
CONNECT_S) tells "nothing answers there" apart in a moment. It cannot tell a GCS from another server on that
port; Ray's own timeout covers that case.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import threading
from collections.abc import Callable
from typing import TypeVar

from fleet.core.errors import InvalidArgument, Unavailable

T = TypeVar("T")

CONNECT_S = 5.0
_NOT_CHECKED = ("", "auto", "local")  # Ray resolves these itself (RAY_ADDRESS, the local head, a new one)


def gcs_host_port(address: str) -> tuple[str, int] | None:
    """The GCS host and port of a Ray address (`host:port`, `ray://host:port`, `[v6]:port`); None for the
    addresses Ray resolves itself. Raises InvalidArgument naming --ray-address for one without a port."""
    addr = address.strip()
    if addr.lower() in _NOT_CHECKED:
        return None
    addr = addr.split("://", 1)[1] if "://" in addr else addr
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"--ray-address {address!r}: expected HOST:PORT of the Ray head's GCS, e.g. 10.0.0.2:6379")
    return host.strip("[]") or "127.0.0.1", int(port)


def unreachable(address: str, timeout_s: float = CONNECT_S) -> str | None:
    """Why nothing accepts a TCP connection at the address's GCS host:port within `timeout_s` ("connection
    refused", "no answer within 5 s"), or None when something does (or Ray resolves the address itself)."""
    hp = gcs_host_port(address)
    if hp is None:
        return None
    try:
        with socket.create_connection(hp, timeout=timeout_s):
            return None
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except OSError as e:
        return (e.strerror or str(e)).lower()


def check_reachable(address: str, timeout_s: float = CONNECT_S) -> None:
    """Raise InvalidArgument, naming --ray-address, when nothing answers at the address (`unreachable`)."""
    if why := unreachable(address, timeout_s):
        raise InvalidArgument(f"--ray-address {address}: no Ray head answers there ({why}); give the address "
                              "`ray start --head` printed, or leave the flag out for a local Ray")


def check_ray(address: str) -> None:
    """Unavailable, naming the Ray address, when nothing answers there (controller/ray_address.py): before, each
    session call waited ~120 s in `ray.init`'s retries."""
    if why := unreachable(address):
        raise Unavailable(f"the session fleet's Ray at {address} (--ray-address) does not answer ({why}); "
                          "session calls fail until a Ray head runs there")


async def on_daemon_thread(fn: Callable[[], T]) -> T:
    """`fn()` on a daemon thread of its own, awaited; the thread then stays (idle) until the process exits.

    NOTE: the fleet's build (`ray.init`) cannot be interrupted; on the admin pool a stuck one kept a stopped
    controller from exiting (the interpreter joins pool threads at exit), so SIGTERM no longer ended `kvfleet
    controller` after one session call. The thread must outlive the build: a local Ray's daemons are started from
    it with a parent-death signal (fleet/app/children.py), which Linux sends when the *thread* that started a child
    ends, not the process; a thread that ended after the build killed the local Ray under the controller (its
    first session call: "Socket closed")."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not fut.done():  # the awaiting call may be cancelled meanwhile
            outcome()

    def run() -> None:
        try:
            out = fn()
            done = functools.partial(fut.set_result, out)
        except BaseException as e:  # noqa: BLE001  (handed to the awaiting call)
            done = functools.partial(fut.set_exception, e)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, done)
        threading.Event().wait()  # never set: the children this thread started live as long as the process

    threading.Thread(target=run, name="kvfleet-sessions-build", daemon=True).start()
    return await fut
