"""The bench's sticky peer takes a worker out on evidence, not on one slow probe answer.

A fresh-clone run once failed the fleet-routing smoke test with the sticky peer answering 503: its 0.5 s probe
of both stand-ins timed out on a loaded machine and it marked both down. A probe with no answer in time now keeps
the worker's state for two probes in a row; a worker that says it sleeps, or refuses connections, is out at once.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from peers.sticky import StickyRouter  # noqa: E402


class Worker:
    """A real HTTP server with vLLM's /health and /is_sleeping, whose answers the test sets."""

    def __init__(self) -> None:
        self.delay_s, self.sleeping = 0.0, False
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def health(self, _: web.Request) -> web.Response:
        await asyncio.sleep(self.delay_s)
        return web.json_response({})

    async def is_sleeping(self, _: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": self.sleeping})

    async def start(self) -> Worker:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/is_sleeping", self.is_sleeping)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def test_slow_answers_keep_a_worker_twice_and_a_sleeping_or_dead_one_is_out_at_once() -> None:
    slow, sleepy = await (Worker()).start(), await (Worker()).start()
    dead = _closed_port()
    router = StickyRouter([slow.url, sleepy.url, dead], probe_interval_s=60.0, probe_timeout_s=0.2)
    await router.start()   # the first probe, all answering in time but the dead one
    try:
        assert router.serving == {slow.url: True, sleepy.url: True, dead: False}
        slow.delay_s, sleepy.sleeping = 0.5, True
        await router._probe_all()
        assert router.serving[slow.url] and not router.serving[sleepy.url]   # one slow answer: kept
        await router._probe_all()
        assert router.serving[slow.url]                                       # two in a row: kept
        await router._probe_all()
        assert not router.serving[slow.url]                                   # three: out (control)
        slow.delay_s = 0.0
        await router._probe_all()
        assert router.serving[slow.url]                                       # answers again: back
        slow.delay_s = 0.5
        await router._probe_all()
        assert router.serving[slow.url]   # the count started again after the answer
    finally:
        await router.stop()
        await slow.stop()
        await sleepy.stop()
