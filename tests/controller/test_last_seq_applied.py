"""A worker's `last_seq` (WorkerStatus, ListWorkers) is the last batch the router has applied, not one it is still
applying. A batch's events are applied in slices that yield to the event loop (controller/vllm/budget.py Slicer);
the rank's state carries the batch's seq from its first slice, and the status row used to report it then: a caller
that waited for `last_seq` to reach the worker's seq (as every test helper waiting for ingestion does) could route
before the batch's blocks were indexed, and got COLD for a prompt the worker held (a fresh-clone CI run on a loaded
machine). The real Router on a `kvfleet sim-vllm` worker; the slices are held open by a gate."""

from __future__ import annotations

import asyncio

import aiohttp
from support.one_worker import one_worker, synced

PROMPT = list(range(1000, 1100))  # 6 full blocks


class GatedSlicer:
    """Yields before every event, each yield waiting for `gate`."""

    def __init__(self) -> None:
        self.gate, self.waiting = asyncio.Event(), asyncio.Event()

    def due(self) -> bool:
        return True

    async def tick(self) -> None:
        self.waiting.set()
        await self.gate.wait()


async def test_a_batch_applied_in_slices_is_reported_read_only_once_applied(tmp_path) -> None:
    async with one_worker(tmp_path, 64) as (r, sim):
        w = r._workers["w0"]
        slicer = w.slicer = GatedSlicer()
        before = r.workers()[0].last_seq
        async with aiohttp.ClientSession() as h, h.post(sim.url + "/v1/completions", json={"prompt": PROMPT}) as resp:
            assert resp.status == 200
        await asyncio.wait_for(slicer.waiting.wait(), 10)
        assert sim.publisher is not None
        seq = sim.publisher.seq - 1
        assert w.ranks[0].seq == seq  # control: the batch is being applied, its seq already in the rank's state
        assert r.workers()[0].last_seq == before < seq  # before the fix: seq
        assert (await r.route(PROMPT, "m")).verdict == "COLD"  # its blocks are not indexed yet
        slicer.gate.set()
        await synced(r, sim)
        assert r.workers()[0].last_seq == seq
        assert (await r.route(PROMPT, "m")).verdict == "WARM"
