"""Two restarts of a worker behind the controller's back, its new publisher's seq reset read between them: the
route-time probe must see the second. The seq reset told the next look "the stream already saw this restart, do
not count it again", whichever restart the look then found: a look that had counted the first restart before the
reset, or none at all, left the flag for the look after the second restart, which then kept the first restarted
process's blocks indexed: WARM routes to an empty cache (the chaos test's stale route, about 1 run in 8).

Real Router on SQLite, one real `kvfleet sim-vllm` stand-in (HTTP, ZMQ PUB and replay); the reconcile loop is off
(30 s), so the only looks are the ones the test makes (route probes), and the oracle is the stand-in's true cache.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
from support.one_worker import synced, warm
from support.stand_ins import complete, routed_stand_ins

from controller.router import Router
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimVllm

A, B = list(range(1000, 1100)), list(range(3000, 3100))  # 6 full blocks each


def _fleet(tmp_path: Path):  # type: ignore[no-untyped-def]
    return routed_stand_ins(tmp_path, SimEngineConfig(model="m", num_blocks=64), n=1, reconcile_interval_s=30.0,
                            http_timeout_s=10.0)


async def _joined(r: Router, sim: SimVllm) -> None:
    """ZMQ's slow joiner: a batch published before the SUB socket connected is lost, and with the reconcile off no
    tail poll replays it; a later batch shows the gap and replay repairs it. Fillers until one is read."""
    for i in range(100):
        assert (await complete(sim.url, [50_000 + i] * 16, 1))[0] == 200
        await asyncio.sleep(0.02)
        if r.worker("w0").ranks[0].seq >= 0:
            return
    raise AssertionError("the router never read a batch of the worker")


async def _stored(r: Router, sim: SimVllm, toks: list[int]) -> None:
    """A request straight to the worker, then wait until a route of it is WARM (its batch read: after a restart
    that is the new publisher's seq 0, whose seq reset `synced` cannot tell from the old one's seq 0)."""
    assert (await complete(sim.url, toks, 1))[0] == 200
    await synced(r, sim)
    await warm(r, toks)


async def _restart(sim: SimVllm) -> None:
    async with aiohttp.ClientSession() as h, h.post(sim.url + "/sim/restart") as resp:
        assert resp.status == 200


def _seq_resets(r: Router) -> float:
    return r.metrics.epoch_bumps.labels("seq_reset")._value.get()


async def test_a_second_restart_after_a_seq_reset_that_a_look_had_counted_is_seen_by_the_probe(tmp_path) -> None:
    async with _fleet(tmp_path) as (r, (sim,)):
        await _joined(r, sim)
        await _stored(r, sim, A)
        await _restart(sim)  # 1: behind its back
        d = await r.route(A, "m", probe=True)
        assert (d.verdict, r.worker("w0").ranks[0].fence) == ("COLD", "reset")  # the probe's look counted it
        await _stored(r, sim, B)  # the new publisher's seq 0: a seq reset, read after the look
        assert _seq_resets(r) == 1
        await _restart(sim)  # 2: B is gone with the process
        d = await r.route(B, "m", probe=True)
        assert sim.engine.resident_external() == []
        assert (d.verdict, d.matched_tokens) == ("COLD", 0)  # before: WARM 96, the second restart not counted


async def test_a_second_restart_after_a_seq_reset_no_look_had_seen_is_seen_by_the_probe(tmp_path) -> None:
    async with _fleet(tmp_path) as (r, (sim,)):
        await _joined(r, sim)
        await _stored(r, sim, A)
        await _restart(sim)  # 1: no look sees it; the stream does (B's seq reset)
        await _stored(r, sim, B)
        assert _seq_resets(r) == 1
        await _restart(sim)  # 2
        d = await r.route(B, "m", probe=True)
        assert sim.engine.resident_external() == []
        assert (d.verdict, d.matched_tokens) == ("COLD", 0)  # before: WARM 96, the look took both for the one seen


async def test_control_a_restart_the_stream_already_reported_keeps_the_new_process_blocks(tmp_path) -> None:
    """The reason the seq reset is remembered at all: the look that then finds the restart does not drop the blocks
    the new process's publisher has proven since."""
    async with _fleet(tmp_path) as (r, (sim,)):
        await _joined(r, sim)
        await _stored(r, sim, A)
        await _restart(sim)
        await _stored(r, sim, B)
        d = await r.route(B, "m", probe=True)
        assert (d.verdict, d.matched_tokens, _seq_resets(r)) == ("WARM", 96, 1)
        assert r.metrics.epoch_bumps.labels("restart")._value.get() == 0  # not counted twice
