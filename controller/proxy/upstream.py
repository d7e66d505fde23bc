"""One send of a routed request to a worker, up to its first body bytes (controller/proxy/forward.py decides where
and how long to wait): a failure before them is an AttemptFailed, and a connection the worker closes under the send
is first sent once more, fresh, to the same worker."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

from controller.proxy.metrics import ProxyMetrics
from controller.proxy.targets import Target


class AttemptFailed(Exception):
    """The worker failed before the first byte: retry elsewhere. `found`: a probe found it asleep or gone (True),
    was asked and found neither (False), or was not asked since the failure (None: Forwarder._judge asks)."""

    def __init__(self, why: str, found: bool | None = None) -> None:
        super().__init__(why)
        self.found = found


class Upstream:
    """`http` is the proxy's pooled session to the workers, `fresh` one that opens a new connection per request
    (TCPConnector(force_close=True)): a send the worker's closing of its connection cut off is repeated on it once
    (None: not repeated)."""

    def __init__(self, http: aiohttp.ClientSession, fresh: aiohttp.ClientSession | None, connect_timeout_s: float,
                 metrics: ProxyMetrics) -> None:
        self.http, self.fresh, self.metrics = http, fresh, metrics
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)  # one for every send

    async def post(self, t: Target, url: str, body: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        """POST on a pooled connection; if the worker closed the connection under the send, send once more, on a
        fresh connection to the same worker.
        NOTE: a server closes a kept-alive connection it found idle too long (uvicorn, vLLM's server: 5 s; aiohttp's
        pool keeps one 15 s), and a send that takes it from the pool as the close is on its way meets a reset: the
        worker never read the request. That failed the attempt over (and, before, marked the worker suspect).
        A connection the pool had kept is not told from a new one: aiohttp says so only through its trace hooks,
        which cost 19 us per request on loopback (176 against 157 us, 2,000 sends x 6); a new connection closed
        under the send costs one more connection to the worker before the failover."""
        try:
            return await self.http.post(url, data=body, headers=headers, timeout=self._timeout)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientConnectionResetError) as e:
            if isinstance(e, aiohttp.ClientConnectorError) or self.fresh is None:  # could not connect: not a close
                raise
        self.metrics.reconnects.labels(t.worker).inc()
        return await self.fresh.post(url, data=body, headers=headers, timeout=self._timeout)

    async def open(self, t: Target, url: str, body: bytes,
                   headers: dict[str, str]) -> tuple[aiohttp.ClientResponse, bytes]:
        """The worker's response and its first body bytes; any failure before them raised as AttemptFailed."""
        try:
            resp = await self.post(t, url, body, headers)
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise AttemptFailed(f"connect: {type(e).__name__}: {e}") from e
        try:
            if resp.status == 503:
                raise AttemptFailed(f"503: {(await resp.content.read(512)).decode(errors='replace')}")
            return resp, await resp.content.readany()
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            resp.close()
            raise AttemptFailed(f"broken: {type(e).__name__}: {e}") from e
        except BaseException:
            resp.close()
            raise


async def discard(task: asyncio.Task[tuple[aiohttp.ClientResponse, bytes]]) -> None:
    """Cancel an attempt; close its response if it had already opened one."""
    task.cancel()
    with contextlib.suppress(BaseException):
        resp, _ = await task
        resp.close()
