"""One vLLM API server in front of two stand-in engines (vLLM's data parallelism, DP=2, internal load balancing):
/metrics merged (engine 1's series relabelled engine="1"), every other path engine 0's. The stand-in runs one
engine per process, so tests of DP workers put two behind this front, each publishing its KV events at P + rank."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from fleet.app.testkit.sim_vllm.main import SimVllm
from support.http_stub import serving


def free_pair() -> int:
    """A port P with P + 1 free too (vLLM's rank r publishes at P + r)."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = int(a.getsockname()[1])
        with socket.socket() as b:
            try:
                b.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise AssertionError("no free port pair")


@contextlib.asynccontextmanager
async def dp_front(e0: SimVllm, e1: SimVllm) -> AsyncIterator[str]:
    """The front's URL while it serves (module doc)."""
    async with aiohttp.ClientSession() as h:

        async def metrics(_: web.Request) -> web.Response:
            async with h.get(e0.url + "/metrics") as a, h.get(e1.url + "/metrics") as b:
                first, second = await a.text(), await b.text()
            ones = [line.replace('engine="0"', 'engine="1"') for line in second.splitlines()
                    if line.startswith("vllm:") and 'engine="0"' in line]
            return web.Response(text=first + "\n".join(ones) + "\n", content_type="text/plain")

        async def forward(req: web.Request) -> web.Response:
            async with h.request(req.method, e0.url + req.path_qs, data=await req.read(),
                                 headers={"Content-Type": req.content_type}) as resp:
                return web.Response(body=await resp.read(), status=resp.status, content_type=resp.content_type)

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_route("*", "/{tail:.*}", forward)
        async with serving(app) as url:
            yield url
