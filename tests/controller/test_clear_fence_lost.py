"""A forgetting verb's fence "clear" waits for the AllBlocksCleared vLLM queued; when that clear can no longer come,
the fence must still lift, or the worker serves, every store ignored, COLD for good.

Two ways it was lost, each against a real `kvfleet sim-vllm` stand-in and the real Router:

- read before the fence went up: the controller resets the worker, and a request behind its back (another router's,
  an SDK caller's) runs a step between vLLM's reset and the controller reading the answer; that step's batch
  [AllBlocksCleared, BlockStored...] arrives while the verb is still out, and the fence then waited for a clear
  already read;
- lost on the wire: the batch carrying the clear is dropped (PUB high-water mark) and replay cannot repair the gap
  (no replay endpoint registered, or its buffer rolled over).

NOTE: before, in both, every later prompt sent to the worker routed COLD with 0 tokens matched while the worker held
it, for as long as the test ran. Now the fence lifts as it does after a faulty hold (watcher.CLEAR_SETTLE_S after it
went up, whatever is read was produced after the clear); the controls keep the clear and lift at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from support.http_stub import serving

from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store

SETTLE_S = 0.5
RACER = list(range(5000, 5100))  # 6 full blocks


def prompt(i: int) -> list[int]:
    return list(range(1000 + 200 * i, 1100 + 200 * i))  # 6 full blocks (96 tokens)


@contextlib.asynccontextmanager
async def fleet(tmp_path: Path, *, race: bool, replay: bool = True) -> AsyncIterator[tuple[Router, SimVllm, Sender]]:
    """w0 is the stand-in behind a relay; with `race`, the relay answers the controller's /reset_prefix_cache only
    after a request behind the controller's back has run on the reset worker and the router has read its events."""
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=64))).start()
    r = Router(store, Metrics(), RouterConfig(reconcile_interval_s=0.1, http_timeout_s=10.0))
    await r.start()
    h = aiohttp.ClientSession()
    send = Sender(r, sim, h)

    async def relay(req: web.Request) -> web.StreamResponse:
        body = await req.read()
        async with h.request(req.method, sim.url + req.path_qs, data=body,
                             headers={"Content-Type": req.content_type}) as resp:
            data, status, ctype = await resp.read(), resp.status, resp.content_type
        if race and req.path == "/reset_prefix_cache":
            await send(RACER)
        return web.Response(body=data, status=status, content_type=ctype)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", relay)
    try:
        async with serving(app) as url:
            await r.register_worker(WorkerSpec("w0", url, sim.kv_events, sim.replay if replay else None, "m"))
            for _ in range(200):
                if r.worker("w0").view().load.num_gpu_blocks:
                    break
                await asyncio.sleep(0.02)
            yield r, sim, send
    finally:
        await h.close()
        await r.stop()
        await sim.stop()
        store.close()


class Sender:
    """One request straight to the worker (behind the router's back); then wait until the router read its batch."""

    def __init__(self, r: Router, sim: SimVllm, h: aiohttp.ClientSession) -> None:
        self.r, self.sim, self.h = r, sim, h

    async def __call__(self, toks: list[int], *, lost: bool = False) -> bool:
        """Whether the router read the batch (True with `lost`): False only while it has read nothing of the stream
        (its subscription was not up when the batch went: ZMQ's slow joiner, seen on a loaded machine when nothing was
        read before the reset; a fresh-clone run failed so). Any other unread batch fails the test."""
        async with self.h.post(self.sim.url + "/v1/completions", json={"prompt": toks}) as resp:
            assert resp.status == 200
        assert self.sim.publisher is not None
        for _ in range(500):
            if lost or self.r.worker("w0").applied_seq(0) >= self.sim.publisher.seq - 1:
                return True
            await asyncio.sleep(0.01)
        if self.r.worker("w0").ranks[0].seq < 0:
            return False
        raise AssertionError("the router never read the worker's batch")


async def routed_after_settle(r: Router, send: Sender, fenced: float) -> list[tuple[str, int]]:
    """A new prompt sent to the worker then routed, one every 0.1 s until SETTLE_S after the fence went up and then
    twice more: (verdict, matched tokens) of each of the last two."""
    out: list[tuple[str, int]] = []
    i = 0
    while time.monotonic() - fenced < SETTLE_S + 0.25 or len(out) < 2:
        read = await send(prompt(i))
        d = await r.route(prompt(i), "m")
        if read and time.monotonic() - fenced > SETTLE_S + 0.05:  # a route decided before its batch was read: not counted
            # NOTE: read is not yet proven warm for the rank's epoch on a busy machine (a fresh-clone run's last route
            # was COLD): it gets 2 s to be, which a fence kept up for good never gives
            for _ in range(20):
                if d.verdict == "WARM":
                    break
                await asyncio.sleep(0.1)
                d = await r.route(prompt(i), "m")
            out.append((d.verdict, d.matched_tokens))
        i += 1
        await asyncio.sleep(0.1)
    return out[-2:]


@pytest.mark.parametrize("race", [True, False])
async def test_a_clear_read_while_the_reset_was_answered_does_not_fence_the_worker_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, race: bool
) -> None:
    import controller.vllm.watcher as watcher

    monkeypatch.setattr(watcher, "CLEAR_SETTLE_S", SETTLE_S, raising=False)
    async with fleet(tmp_path, race=race) as (r, sim, send):
        w = await r.lifecycle("w0", "reset_prefix_cache")
        fenced = time.monotonic()
        assert w.kv == "forgotten"
        if not race:  # control: the clear comes after the verb, with the next step
            await send(RACER)
        got = await routed_after_settle(r, send, fenced)
        print(f"race={race}: new prompts sent after the reset route {got}, fence {r.worker('w0').ranks[0].fence!r}")
        assert r.worker("w0").ranks[0].fence == ""  # before (race): 'clear' for good
        assert got == [("WARM", 96), ("WARM", 96)]  # before (race): [('COLD', 0), ('COLD', 0)]


@pytest.mark.parametrize(("lose", "read_before"), [(True, True), (True, False), (False, True)])
async def test_a_clear_lost_in_a_gap_replay_cannot_repair_does_not_fence_the_worker_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lose: bool, read_before: bool
) -> None:
    """`read_before`: the router read a batch of the worker before the reset (a gap, unrepaired); else the lost batch
    was the head of its stream (nothing to call a gap: a suffix of a fresh stream is sound, and the clear is gone)."""
    import controller.vllm.watcher as watcher

    monkeypatch.setattr(watcher, "CLEAR_SETTLE_S", SETTLE_S, raising=False)
    async with fleet(tmp_path, race=False, replay=False) as (r, sim, send):
        for i in range(50 if read_before else 0):  # until one is read (ZMQ drops what a PUB sends before the SUB joins)
            await send(list(range(7000 + 50 * i, 7040 + 50 * i)), lost=True)
            await asyncio.sleep(0.05)
            if r.worker("w0").ranks[0].seq >= 0:
                break
        assert r.worker("w0").ranks[0].seq >= 0 or not read_before
        await r.lifecycle("w0", "reset_prefix_cache")  # idle: vLLM resets; its clear leaves with the next step
        fenced = time.monotonic()
        if lose:
            async with send.h.post(sim.url + "/sim/drop_next_events?n=1") as resp:
                assert resp.status == 200
        await send(RACER, lost=lose)  # the step that carries the clear (lost: a gap the next batch shows)
        got = await routed_after_settle(r, send, fenced)
        print(f"lose={lose}, read_before={read_before}: new prompts sent after the reset route {got}, fence {r.worker('w0').ranks[0].fence!r}")
        assert r.worker("w0").ranks[0].fence == ""  # before (lost): 'clear' for good
        assert got == [("WARM", 96), ("WARM", 96)]  # before (lost): [('COLD', 0), ('COLD', 0)]
