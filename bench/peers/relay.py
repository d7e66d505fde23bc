"""The reverse-proxy plumbing the bench's own small routers share: forward a POST, relay the bytes.

A client that goes away cancels the handler (`handler_cancellation=True`), which closes the
upstream connection, so the worker aborts the request as vLLM would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

RELAYED = ("Content-Type", "Cache-Control")


async def relay(
    req: web.Request,
    http: aiohttp.ClientSession,
    base_url: str,
    body: bytes,
    extra: dict[str, str] | None = None,
) -> web.StreamResponse:
    """POST `body` to base_url + req.path and stream the answer back unchanged (plus `extra` headers)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=2.0)
    async with http.post(
        base_url.rstrip("/") + req.path,
        data=body,
        timeout=timeout,
        headers={"Content-Type": "application/json"},
    ) as up:
        headers = {k: up.headers[k] for k in RELAYED if k in up.headers}
        out = web.StreamResponse(status=up.status, headers={**headers, **(extra or {})})
        await out.prepare(req)
        async for chunk in up.content.iter_any():
            await out.write(chunk)
        await out.write_eof()
        return out


def error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "ServiceUnavailableError", "code": status}}, status=status
    )


async def serve(
    app: web.Application,
    listen: str,
    on_start: Callable[[], Awaitable[None]] | None = None,
    on_stop: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Serve `app` on HOST:PORT until SIGINT/SIGTERM; print one JSON line once listening."""
    host, port = listen.rsplit(":", 1)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, int(port))
    await site.start()
    if on_start is not None:
        await on_start()
    print(json.dumps({"url": f"http://{listen}"}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    if on_stop is not None:
        await on_stop()
