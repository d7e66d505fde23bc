"""A session-sticky consistent-hash router: hash(session id) -> worker, skipping workers that are down or asleep.

    python bench/peers/sticky.py --listen 127.0.0.1:9100 --worker http://127.0.0.1:8101 --worker ...

The session id is the `x-session-id` header, else the body's `user` field, else the first
message. Every `--probe-interval` seconds each worker is probed: GET /health must answer 200 and
GET /is_sleeping must not say true (a sleeping vLLM keeps /health at 200). A probe with no answer within
`--probe-timeout` (2 s) leaves the worker as it was, up to two in a row: a slow answer on a loaded machine is not
a sleep, and a worker that refuses connections or answers wrong is out at once. NOTE: at 0.5 s, a fresh-clone run
of the suite on a loaded machine had all 40 requests of the smoke test answered 503 "no serving worker", most likely
every probe timing out; a sleeping stand-in answers /is_sleeping at once, so the longer bound changes nothing the
bench's hazards do. A request goes to the
first serving worker clockwise from the session's point on the ring (64 virtual nodes per
worker), so a session moves only while its worker is out, and comes back after.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
from relay import error, relay, serve  # noqa: E402


def point(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


class HashRing:
    """Workers placed at `vnodes` points each; `walk(key)` yields each worker once, clockwise from key."""

    def __init__(self, workers: list[str], vnodes: int = 64) -> None:
        assert workers and vnodes > 0
        self.points = sorted((point(f"{w}#{i}"), w) for w in workers for i in range(vnodes))
        self.num_workers = len(set(workers))

    def walk(self, key: str) -> Iterator[str]:
        start = bisect.bisect(self.points, (point(key), ""))
        seen: set[str] = set()
        for i in range(len(self.points)):
            w = self.points[(start + i) % len(self.points)][1]
            if w not in seen:
                seen.add(w)
                yield w
                if len(seen) == self.num_workers:
                    return


def session_key(req: web.Request, body: bytes) -> str:
    if req.headers.get("x-session-id"):
        return req.headers["x-session-id"]
    with contextlib.suppress(ValueError, AttributeError, KeyError, IndexError, TypeError):
        doc = json.loads(body)
        return str(doc.get("user") or json.dumps(doc.get("messages", [doc.get("prompt")])[0]))
    return ""


class StickyRouter:
    def __init__(self, workers: list[str], probe_interval_s: float = 0.5, probe_timeout_s: float = 2.0) -> None:
        self.workers, self.ring, self.probe_s = workers, HashRing(workers), probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.serving = {w: True for w in workers}
        self._timeouts = {w: 0 for w in workers}  # probes in a row with no answer in time
        self.http: aiohttp.ClientSession | None = None
        self._probe: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        await self._probe_all()
        self._probe = asyncio.create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.probe_s)
            await self._probe_all()

    async def _probe_all(self) -> None:
        results = await asyncio.gather(*(self._is_serving(w) for w in self.workers))
        self.serving = dict(zip(self.workers, results, strict=True))

    async def _is_serving(self, url: str) -> bool:
        assert self.http is not None
        timeout = aiohttp.ClientTimeout(total=self.probe_timeout_s)
        try:
            async with self.http.get(url + "/health", timeout=timeout) as r:
                if r.status != 200:
                    return False
            async with self.http.get(url + "/is_sleeping", timeout=timeout) as r:
                serving = r.status == 404 or not (await r.json(content_type=None)).get("is_sleeping")
        except TimeoutError:
            self._timeouts[url] += 1
            return self.serving[url] and self._timeouts[url] < 3
        except (aiohttp.ClientError, OSError, ValueError, AttributeError):
            serving = False
        self._timeouts[url] = 0
        return serving

    async def stop(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
        if self.http is not None:
            await self.http.close()

    def pick(self, key: str) -> str | None:
        return next((w for w in self.ring.walk(key) if self.serving.get(w)), None)

    async def handle(self, req: web.Request) -> web.StreamResponse:
        assert self.http is not None
        body = await req.read()
        worker = self.pick(session_key(req, body))
        if worker is None:
            return error(503, "no serving worker")
        return await relay(req, self.http, worker, body, {"x-sticky-worker": worker})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/health", lambda r: web.json_response({"serving": sum(self.serving.values())}))
        return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--listen", default="127.0.0.1:9100")
    p.add_argument("--worker", action="append", required=True, help="worker base URL (repeat)")
    p.add_argument("--probe-interval", type=float, default=0.5)
    p.add_argument("--probe-timeout", type=float, default=2.0)
    a = p.parse_args(argv)
    router = StickyRouter([w.rstrip("/") for w in a.worker], a.probe_interval, a.probe_timeout)
    asyncio.run(serve(router.app(), a.listen, router.start, router.stop))
    return 0


if __name__ == "__main__":
    sys.exit(main())
