"""What `kvfleet up` checks before it starts anything: the --listen port is free and a server store answers.

NOTE: both were found only after the local Ray had come up (about 10 s) and the state dir, its tokens file and the
SQLite store had been made: `kvfleet up` then exited 2 and left them behind (found by review). The controller's own
bind and store open still decide (a port taken between this check and the bind is refused there); this only makes
the common mistakes cheap, and leaves the state dir untouched.
"""

from __future__ import annotations

import socket

from fleet.core.errors import InvalidArgument, KvfleetError


def check_can_start(listen: str, store_url: str | None) -> None:
    """Raises InvalidArgument naming --listen when its port is taken, and the store's own error naming --store
    (Unavailable: Redis down; InvalidArgument: an unknown URL or a Redis that evicts keys) when `store_url` is not
    SQLite's."""
    if (why := port_taken(listen)) is not None:
        raise InvalidArgument(f"cannot listen on {listen}: {why}; pick another --listen HOST:PORT")
    if store_url and not store_url.startswith("sqlite:"):
        from fleet.cas import open_store

        try:
            open_store(store_url).close()  # redis: connects, pings and checks its eviction policy
        except KvfleetError as e:  # NOTE: the flag was not named, as the README says it is (a new user's run)
            raise type(e)(f"--store: {e}") from None


def port_taken(listen: str) -> str | None:
    """Why the controller could not bind `listen` (HOST:PORT, already checked by server.listen_error), or None.
    Port 0 (any free one) is never taken. The socket is bound as gRPC binds it: SO_REUSEADDR, no SO_REUSEPORT
    (controller/edge.py turns that off)."""
    host, port = listen.rsplit(":", 1)
    if int(port) == 0:
        return None
    try:
        addrs = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"{host!r} is not an address of this machine ({e.strerror})"
    for family, kind, proto, _, addr in addrs:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as e:
                return e.strerror or str(e)
    return None
