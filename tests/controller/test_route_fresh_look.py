"""A route that finds no worker serving has every worker look again before it is refused, and that look is fresh:
begun after the route came. A worker whose look was in progress was skipped (the reconcile loop's rule: no second
look while one runs); that look may have been fetched before the worker woke, and the route was refused "every
candidate is asleep" with the worker awake and serving (a fresh-clone CI run on a loaded machine). Here the look in
progress is a held lock. The real Router on a `kvfleet sim-vllm` worker."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from support.one_worker import complete_direct, one_worker

from fleet.core.errors import Unavailable

TOKS = list(range(1000, 1100))


async def test_a_route_finding_none_serving_waits_for_a_fresh_look(tmp_path) -> None:
    async with one_worker(tmp_path, 64) as (r, sim), aiohttp.ClientSession() as h:
        w = r._workers["w0"]
        await complete_direct(sim, r, TOKS)
        async with h.post(sim.url + "/sleep", params={"level": "1"}) as resp:
            assert resp.status == 200
        with pytest.raises(Unavailable, match="asleep"):  # control: a fresh look sees it asleep
            await r.route(TOKS, "m", probe=True)
        async with h.post(sim.url + "/wake_up") as resp:
            assert resp.status == 200
        await w.lock.acquire()  # a look in progress (fetched, say, before the wake)
        asyncio.get_running_loop().call_later(0.3, w.lock.release)
        d = await r.route(TOKS, "m", probe=True)  # before: Unavailable, the look skipped
        assert (d.worker, d.verdict) == ("w0", "COLD")  # its level-1 sleep wiped the cache


async def test_calls_waiting_for_a_look_share_the_one_begun_after_them(tmp_path) -> None:
    """Twenty routes that find no worker serving while a look is in progress: one fresh look answers them all, not a
    queue of twenty (each up to the HTTP timeout against a worker that does not answer)."""
    async with one_worker(tmp_path, 64) as (r, sim), aiohttp.ClientSession() as h:
        w = r._workers["w0"]
        async with h.post(sim.url + "/sleep", params={"level": "1"}) as resp:
            assert resp.status == 200
        await w.look()
        fetches = 0
        fetch = w.fetch

        async def counted():  # type: ignore[no-untyped-def]
            nonlocal fetches
            fetches += 1
            return await fetch()

        w.fetch = counted  # type: ignore[method-assign]

        async def no_look() -> None:  # the reconcile loop's own looks, left out of the count (a loaded CI run: 2)
            return None

        w.reconcile_once = no_look  # type: ignore[method-assign]
        await w.lock.acquire()  # a look in progress
        asyncio.get_running_loop().call_later(0.3, w.lock.release)
        got = await asyncio.gather(*(r.route(TOKS, "m", probe=True) for _ in range(20)), return_exceptions=True)
        assert all(isinstance(e, Unavailable) for e in got)  # asleep, as the fresh look saw
        assert fetches == 1
