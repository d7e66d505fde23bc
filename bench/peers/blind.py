"""kvfleet's lifecycle-blind prefix router (fleet/app/testkit/baseline.py) behind an HTTP front, for the bench.

    python bench/peers/blind.py --listen 127.0.0.1:9200 --worker http://127.0.0.1:8101=tcp://127.0.0.1:5557 ...

What shipped routers do: the worker with the longest prefix in an index fed by KV events and
cleared only by AllBlocksCleared (no serving state, no epochs, no reconcile loop). The prompt's
token ids come from a worker's /tokenize, as the kvfleet proxy gets them; a token-id prompt is
used as it is. Block size 16, sha256 hashing, no salt (the stand-ins' defaults).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from relay import error, relay, serve  # noqa: E402

from fleet.app.testkit.baseline import BaselineRouter  # noqa: E402
from fleet.core.block_hash import HashConfig  # noqa: E402


class BlindFront:
    def __init__(self, workers: dict[str, tuple[str, str]], block_size: int = 16) -> None:
        self.workers = workers  # name -> (url, kv_events endpoint)
        self.block_size = block_size
        self.router: BaselineRouter | None = None
        self.http: aiohttp.ClientSession | None = None
        self._next = 0

    async def start(self) -> None:
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.router = BaselineRouter(HashConfig("sha256", None, self.block_size))
        for name, (_, kv) in self.workers.items():
            self.router.add_worker(name, kv)

    async def stop(self) -> None:
        if self.router is not None:
            await self.router.stop()
        if self.http is not None:
            await self.http.close()

    async def token_ids(self, doc: dict[str, Any], chat: bool) -> list[int]:
        p = doc.get("prompt")
        if not chat and isinstance(p, list) and p and all(isinstance(t, int) for t in p):
            return [int(t) for t in p]
        assert self.http is not None
        urls = [u for u, _ in self.workers.values()]
        self._next = (self._next + 1) % len(urls)  # any worker tokenizes identically
        req = {"model": doc.get("model"), **({"messages": doc["messages"]} if chat else {"prompt": p})}
        async with self.http.post(
            urls[self._next] + "/tokenize", json=req, timeout=aiohttp.ClientTimeout(total=5)
        ) as r:
            return list((await r.json())["tokens"])

    async def handle(self, req: web.Request) -> web.StreamResponse:
        assert self.router is not None and self.http is not None
        body = await req.read()
        try:
            ids = await self.token_ids(json.loads(body), req.path.endswith("/chat/completions"))
        except (ValueError, KeyError, TypeError, aiohttp.ClientError, TimeoutError) as e:
            return error(400, f"cannot tokenize: {e}")
        d = self.router.route(ids)
        url = self.workers[d.worker][0]
        return await relay(
            req,
            self.http,
            url,
            body,
            {
                "x-blind-worker": d.worker,
                "x-blind-verdict": d.verdict,
                "x-blind-matched-tokens": str(d.matched_tokens),
            },
        )

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/health", lambda r: web.json_response({"workers": len(self.workers)}))
        return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--listen", default="127.0.0.1:9200")
    p.add_argument("--worker", action="append", required=True, help="URL=KV_EVENTS_ENDPOINT (repeat)")
    p.add_argument("--block-size", type=int, default=16)
    a = p.parse_args(argv)
    workers = {f"w{i}": tuple(w.split("=", 1)) for i, w in enumerate(a.worker)}
    front = BlindFront({n: (u.rstrip("/"), kv) for n, (u, kv) in workers.items()}, a.block_size)
    asyncio.run(serve(front.app(), a.listen, front.start, front.stop))
    return 0


if __name__ == "__main__":
    sys.exit(main())
