"""The proxy's tokenize cache is bounded in bytes and shared fairly between tenants.

Before, it was one LRU of 4,096 entries for all tenants, holding each answer as a list of Python ints (about 36
bytes an id) whatever its length: a tenant sending distinct long prompts grew the proxy's memory by about 35 MiB
per million ids cached (4,096 such entries: over 100 GiB), and its flood evicted every other tenant's entries.
A real aiohttp server on loopback answers /tokenize; the proxy's Tokenizer calls it.
"""

from __future__ import annotations

import gc
import tracemalloc

import aiohttp
import msgspec
from aiohttp import web
from support.http_stub import serving

from controller.proxy.config import ProxyConfig
from controller.proxy.token_cache import ENTRY_BYTES, ID_BYTES, TokenCache
from controller.proxy.tokenize import Tokenizer

N = 100_000
LONG = msgspec.json.encode({"tokens": list(range(1000, 1000 + N))})  # a 100,000-id answer (~400 KB of text)


class _Directory:
    def __init__(self, url: str) -> None:
        self.url = url

    def tokenizer_urls(self, base: str, listing: str | None = None) -> list[str]:
        return [self.url]


async def _tokenizer_against(answer: bytes, cfg: ProxyConfig, run) -> None:  # type: ignore[no-untyped-def]
    async def tokenize(_: web.Request) -> web.Response:
        return web.Response(body=answer, content_type="application/json")

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    async with serving(app) as url, aiohttp.ClientSession() as http:
        await run(Tokenizer(cfg, _Directory(url), http))  # type: ignore[arg-type]


def _prompt(tenant: str, i: int) -> dict[str, object]:
    return {"model": "m", "prompt": f"{tenant} prompt {i}"}


async def test_long_answers_are_held_within_the_byte_budget() -> None:
    cfg = ProxyConfig(controller="127.0.0.1:1", tokenize_cache_bytes=4 << 20)  # 4 MiB: a small budget, a fast test

    async def run(tok: Tokenizer) -> None:
        await tok.token_ids(_prompt("a", -1), False, "m", "a")  # the session's and decoder's first allocations
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for i in range(24):
                assert len(await tok.token_ids(_prompt("a", i), False, "m", "a")) == N
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        print(f"24 distinct {N:,}-id answers cached: {held / 2**20:.1f} MiB held, "
              f"{tok.cache.num_entries} entries, {tok.cache.num_bytes / 2**20:.1f} MiB counted")
        assert tok.cache.num_bytes <= cfg.tokenize_cache_bytes
        assert held < cfg.tokenize_cache_bytes + (1 << 20)  # the old cache held 24 x 3.5 MiB here
        assert tok.cache.num_entries == cfg.tokenize_cache_bytes // (N * ID_BYTES + ENTRY_BYTES)
        calls = tok.num_calls
        assert list(await tok.token_ids(_prompt("a", 23), False, "m", "a")) == list(range(1000, 1000 + N))
        assert tok.num_calls == calls  # the latest is a hit, as it was

    await _tokenizer_against(LONG, cfg, run)


async def test_one_tenants_flood_does_not_evict_anothers_entries() -> None:
    cfg = ProxyConfig(controller="127.0.0.1:1", tokenize_cache_size=64)

    async def run(tok: Tokenizer) -> None:
        for i in range(4):
            await tok.token_ids(_prompt("b", i), False, "m", "b")
        for i in range(1000):  # tenant a: distinct prompts, far past the cache's 64 entries
            await tok.token_ids(_prompt("a", i), False, "m", "a")
        calls = tok.num_calls
        for i in range(4):
            await tok.token_ids(_prompt("b", i), False, "m", "b")
        assert tok.num_calls == calls, "tenant b's entries were evicted by tenant a's flood"
        await tok.token_ids(_prompt("a", 0), False, "m", "a")
        assert tok.num_calls == calls + 1  # the control: the flood evicted its own oldest entries
        assert tok.cache.num_entries == 64

    await _tokenizer_against(b'{"tokens": [5, 6, 7]}', cfg, run)


def test_the_cache_evicts_the_largest_holder_first() -> None:
    size = 100 * ID_BYTES + ENTRY_BYTES
    c = TokenCache(max_entries=100, max_bytes=10 * size)
    for i in range(3):
        c.put("small", i, range(100))
    for i in range(20):
        c.put("big", i, range(100))
    assert c.num_bytes <= 10 * size and c.num_entries == 10
    assert [c.get("small", i) is not None for i in range(3)] == [True] * 3
    assert c.tenant_bytes("big") == 7 * size
    assert c.get("big", 19) is not None and c.get("big", 12) is None  # big kept its seven latest
    # a tenant alone may use the whole budget
    solo = TokenCache(max_entries=100, max_bytes=10 * size)
    for i in range(20):
        solo.put("a", i, range(100))
    assert solo.num_entries == 10 and solo.get("a", 10) is not None


def test_what_is_not_cached() -> None:
    c = TokenCache(max_entries=10, max_bytes=4 * (100 * ID_BYTES + ENTRY_BYTES))
    c.put("a", "big", range(101))  # over a quarter of the bytes
    c.put("a", "negative", [1, -1])  # ids the router would refuse
    c.put("a", "wide", [1, 2**32])
    assert c.num_entries == 0 and c.get("a", "big") is None
    c.put("a", "ok", range(100))
    assert list(c.get("a", "ok") or ()) == list(range(100)) and c.get("b", "ok") is None  # per tenant
    off = TokenCache(max_entries=0, max_bytes=1 << 20)
    off.put("a", "k", [1])
    assert off.get("a", "k") is None
