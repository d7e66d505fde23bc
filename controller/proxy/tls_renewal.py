"""The proxy's TLS files for its channel to the controller, looked at now and then (ControlClient.watch_tls).

When they changed since the stamp taken before the channel's credentials were read, and they load whole, new
calls go over a new channel with the new credentials (`relink`); the channel it replaced closes RETIRE_S later
(the proxy's calls to the controller take seconds at most; one still running then is cut).
NOTE: before, the files were read once: a client certificate renewed in the mounted Secret was not presented
until the proxy restarted, and once the old one expired the controller refused every new connection (the proxy
fails closed: every request a 503).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from controller.periodic import Periodic
from controller.proxy.route_stream import RouteStreams
from controller.tls_reload import Stamp, file_stamp
from fleet.core.errors import InvalidArgument

log = logging.getLogger("kvfleet.proxy")
RETIRE_S = 60.0  # how long a channel a TLS renewal replaced stays open for the calls begun on it

# new calls go over a new channel with these credentials; returns the channel (and its streams) it replaced
Relink = Callable[[grpc.ChannelCredentials | None], tuple[grpc.aio.Channel, RouteStreams | None]]


class TlsRenewal:
    """Looks at `paths` every `interval_s` (from `start`); `load` reads them into credentials."""

    def __init__(self, paths: tuple[str, ...], load: Callable[[], grpc.ChannelCredentials | None], stamp: Stamp,
                 relink: Relink, interval_s: float) -> None:
        self._tls = (paths, load, stamp)
        self._relink = relink
        self._retiring: set[asyncio.Task[None]] = set()  # channels replaced by a renewal, closing after a grace
        self._watch = Periodic("kvfleet-proxy-tls", interval_s, self._check,
                               on_error=lambda e: log.warning("proxy: looking at the TLS files failed: %s", e))

    async def start(self) -> None:
        await self._watch.start()

    async def stop(self) -> None:
        """Stop looking, and close the replaced channels now."""
        await self._watch.stop()
        for task in list(self._retiring):
            task.cancel()  # NOTE: its finally closes that channel
        await asyncio.gather(*self._retiring, return_exceptions=True)

    async def _check(self) -> None:
        paths, load, stamp = self._tls
        now = file_stamp(paths)
        if now == stamp:
            return
        try:
            credentials = load()
        except InvalidArgument as e:
            log.warning("proxy: the TLS files changed but do not load (%s); still using the previous ones", e)
            return
        if file_stamp(paths) != now:
            return  # changed while read: load them at the next look
        self._tls = (paths, load, now)
        old = self._relink(credentials)
        task = asyncio.get_running_loop().create_task(self._retire(*old))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        log.info("proxy: TLS files renewed (%s); new calls to the controller use them", ", ".join(paths))

    async def _retire(self, channel: grpc.aio.Channel, streams: RouteStreams | None) -> None:
        """Close a replaced channel RETIRE_S from now: the calls begun on it have had that long to end."""
        try:
            await asyncio.sleep(RETIRE_S)
        finally:
            if streams is not None:
                await streams.close()
            await channel.close()
