"""A request queued behind a wait-mode drain is failed over once the drain ends, not left waiting for its probe.

vLLM's /sleep or /pause with mode=wait lets the running requests finish and keeps the waiting ones (queued, no
blocks yet) for the resume or the wake. The controller lists the worker draining meanwhile, and the proxy keeps its
waiters (what runs there is answered there). Once the verb is over the worker is listed sleeping or paused; the proxy
did not take that as "stopped serving" (it was not serving before either), so the queued request waited for its own
next probe: with a 60 s first-byte timeout, a minute, while the other worker was free. Now the drain's end nudges its
waiters as a sleep does: the queued request is sent to the other worker (x-kvfleet-attempts 2), or, on the model's
only worker, answered 503 (retry shortly), as for a slept worker. Real parts: a controller, clocked sim-vllm workers
running one request at a time (max_num_seqs 1), a proxy in front; the verb goes through the SDK.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from support.proxy_fleet import MODEL, Fleet, served, start_fleet, until

from controller.cost import CostConfig

PROMPT = "Draft the release notes for the storage layer, one item per change. " * 8
ENGINE = {"time_scale": 1.0, "decode_base_s": 0.01, "max_num_seqs": 1}  # ~10 ms a token, one request at a time
COST = CostConfig(queue_weight=0.0, request_weight=0.0)  # the warm worker gets both requests, load aside
PROXY = {"first_byte_timeout_s": 60.0, "max_first_byte_wait_s": 120.0}  # no probe of its own within the test
VERBS = {"sleep": ({"level": 1, "mode": "wait"}, "sleeping", "wake_up"),
         "pause": ({"mode": "wait", "clear_cache": False}, "paused", "resume")}


Answer = asyncio.Task[tuple[int, dict[str, str], bytes]]


async def _queued_behind_a_running_one(fleet: Fleet) -> tuple[str, Answer, Answer]:
    """A (120 tokens, ~1.2 s) running and B queued behind it, both on the worker whose cache holds the prompt."""
    status, h, _ = await fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
    assert status == 200
    x = h["x-kvfleet-worker"]
    await until(lambda: fleet.blocks_known(x), lambda n: n > 0)
    sched = fleet.sims[x].engine.sched
    a = asyncio.create_task(fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 120}))
    await until(_now(lambda: len(sched.running)), lambda n: n == 1, timeout=5.0)
    b = asyncio.create_task(fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPT + "B", "max_tokens": 5}))
    await until(_now(lambda: len(sched.waiting)), lambda n: n == 1, timeout=5.0)
    return x, a, b


def _now(fn: Callable[[], int]) -> Callable[[], Awaitable[int]]:
    async def call() -> int:
        return fn()

    return call


@pytest.mark.parametrize("verb", ["sleep", "pause"])
async def test_a_request_queued_behind_a_wait_drain_is_answered_elsewhere(tmp_path: Path, verb: str) -> None:
    fleet = await start_fleet(tmp_path, num_workers=2, engine_kw=ENGINE, cost=COST, **PROXY)
    kw, phase, back = VERBS[verb]
    x = ""
    try:
        x, a, b = await _queued_behind_a_running_one(fleet)
        other = next(n for n in fleet.sims if n != x)
        w = await fleet.op.lifecycle(x, verb, **kw)
        answered = time.monotonic()
        sa, ha, raw_a = await asyncio.wait_for(a, 10.0)
        sb, hb, raw_b = await asyncio.wait_for(b, 10.0)  # before: its first probe, 60 s after its send
        took = time.monotonic() - answered
        print(f"wait-{verb}: A {sa} from {ha.get('x-kvfleet-worker')} attempts {ha.get('x-kvfleet-attempts')}; "
              f"B {sb} from {hb.get('x-kvfleet-worker')} attempts {hb.get('x-kvfleet-attempts')}, {took:.2f}s after "
              f"the verb answered")
        assert (w.phase, w.serving) == (phase, False)
        # control: the running one drained and was answered there, once
        assert sa == 200 and ha["x-kvfleet-worker"] == x and ha["x-kvfleet-attempts"] == "1", raw_a[:300]
        assert sb == 200 and hb["x-kvfleet-worker"] == other and hb["x-kvfleet-attempts"] == "2", raw_b[:300]
        assert len(served(fleet.sims[other], "/v1/completions")) == 1
    finally:
        if x:
            await fleet.op.lifecycle(x, back)
        await fleet.stop()


async def test_on_the_models_only_worker_the_queued_request_gets_a_503(tmp_path: Path) -> None:
    """No other worker: the queued request is answered 503 (retry shortly) once the drain ends, as a slept worker's
    waiters are; the running one is answered there."""
    fleet = await start_fleet(tmp_path, num_workers=1, engine_kw=ENGINE, cost=COST, **PROXY)
    (x,) = fleet.sims
    try:
        _, a, b = await _queued_behind_a_running_one(fleet)
        w = await fleet.op.lifecycle(x, "sleep", level=1, mode="wait")
        sa, ha, raw_a = await asyncio.wait_for(a, 10.0)
        sb, _, raw_b = await asyncio.wait_for(b, 10.0)
        print(f"wait-sleep of the only worker: A {sa} attempts {ha.get('x-kvfleet-attempts')}; B {sb} {raw_b[:120]!r}")
        assert (w.phase, w.serving) == ("sleeping", False)
        assert sa == 200 and ha["x-kvfleet-attempts"] == "1", raw_a[:300]
        assert sb == 503 and b"a worker asleep" in raw_b and b"retry shortly" in raw_b, raw_b[:300]
    finally:
        await fleet.op.lifecycle(x, "wake_up")
        await fleet.stop()
