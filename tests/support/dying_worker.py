"""A stand-in worker's process dying in the middle of an answer, for the proxy's tests (inside an aiohttp middleware
of the stand-in's app)."""

from __future__ import annotations

import asyncio

from aiohttp import web


async def die_after(req: web.Request, headers: dict[str, str], first: bytes) -> web.StreamResponse:
    """Answer `req` with `headers` and the bytes `first`, then die: the connection is aborted 50 ms later, nothing
    more is written, and the handler never returns (as a killed process's would not)."""
    out = web.StreamResponse(headers=headers)
    await out.prepare(req)
    await out.write(first)
    await asyncio.sleep(0.05)
    assert req.transport is not None
    req.transport.abort()  # the worker's process dies
    await asyncio.sleep(3600)
    return out
