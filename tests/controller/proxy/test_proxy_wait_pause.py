"""A pause with mode=wait through the controller lets the requests already on the worker finish there.

vLLM's /pause?mode=wait starts no new request, lets those in flight complete, then pauses, and answers once they
have; meanwhile its /is_sleeping already answers true. The controller lists the worker "draining" while such a verb
is in flight (not serving: nothing new goes there). The proxy used to take the listing's "not serving" as a cue to
probe the worker at once, found it "asleep" and pulled every request waiting on it: sent again to another worker
from scratch (x-kvfleet-attempts 2), or, with no other worker, a 503, where the worker would have answered. Now it
keeps waiting for a draining worker's answer. Control: a pause with mode=abort (vLLM ends the requests) still fails
them over. Real parts: a controller, clocked sim-vllm workers (time_scale 1: an answer takes its modelled steps),
a proxy in front; the verb goes through the SDK.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from support.proxy_fleet import MODEL, Fleet, served, start_fleet, until
from support.stand_ins import runs_a_request

PROMPT = "Draft the release notes for the storage layer, one item per change. " * 2
ENGINE = {"time_scale": 1.0, "decode_base_s": 0.01}  # ~10 ms a token: 120 tokens take ~1.2 s
TOKENS = 120


async def _phase(fleet: Fleet, name: str) -> str:
    return next(r.phase for w in await fleet.op.workers() if w.name == name for r in w.ranks)


async def _started(fleet: Fleet) -> tuple[asyncio.Task[tuple[int, dict[str, str], bytes]], str]:
    """A non-streamed request through the proxy, running on its worker (in its batch, not queued: a pause with
    mode=wait drains only what runs)."""
    task = asyncio.create_task(fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS}))

    def running() -> str | None:
        return next((n for n, s in fleet.sims.items() if runs_a_request(s)), None)

    async def poll() -> str | None:
        return running()

    return task, await until(poll, lambda n: n is not None, timeout=5.0)


async def _paused_under_a_request(fleet: Fleet, mode: str) -> tuple[int, dict[str, str], bytes, str, Any, float]:
    task, x = await _started(fleet)
    t0 = time.monotonic()
    verb = asyncio.create_task(fleet.op.lifecycle(x, "pause", mode=mode, clear_cache=False))
    status, h, raw = await asyncio.wait_for(task, 10.0)
    took = time.monotonic() - t0
    return status, h, raw, x, await verb, took


async def test_a_wait_pause_lets_the_only_workers_request_finish(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, num_workers=1, engine_kw=ENGINE)
    (x,) = fleet.sims
    try:
        task, _ = await _started(fleet)
        phases: list[str] = []
        verb = asyncio.create_task(fleet.op.lifecycle(x, "pause", mode="wait", clear_cache=False))
        while not task.done():  # what the listing says meanwhile
            phases.append(await _phase(fleet, x))
            await asyncio.sleep(0.05)
        status, h, raw = await task
        w = await verb
        print(f"wait-pause of the only worker under a request: {status}, attempts {h.get('x-kvfleet-attempts')}; "
              f"listed {sorted(set(phases))}")
        assert status == 200 and h["x-kvfleet-attempts"] == "1" and h["x-kvfleet-worker"] == x, raw[:300]
        assert "draining" in phases
        assert (w.phase, w.kv, w.serving) == ("paused", "preserved", False)
        assert await _phase(fleet, x) == "paused"  # the verb returned: paused, not serving, as before
        assert fleet.sims[x].engine.is_sleeping()
        status, _, _ = await fleet.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert status == 503  # nothing serves now
    finally:
        await fleet.op.lifecycle(x, "resume")
        await fleet.stop()


async def test_a_wait_pause_answers_from_the_paused_worker_not_another(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, num_workers=2, engine_kw=ENGINE)
    try:
        status, h, raw, x, w, took = await _paused_under_a_request(fleet, "wait")
        other = next(n for n in fleet.sims if n != x)
        print(f"wait-pause under a request: {status} from {h.get('x-kvfleet-worker')} (paused {x}), attempts "
              f"{h.get('x-kvfleet-attempts')}, {took:.2f}s; {other} got {len(served(fleet.sims[other]))} requests")
        assert status == 200 and h["x-kvfleet-worker"] == x and h["x-kvfleet-attempts"] == "1", raw[:300]
        assert served(fleet.sims[other], "/v1/completions") == []
        assert (w.phase, w.serving) == ("paused", False)
    finally:
        await fleet.stop()


async def test_a_probe_that_finds_it_asleep_asks_the_controller_before_giving_up(tmp_path: Path) -> None:
    """The route is older than --route-reconcile-grace, so the pause reaches the worker at once, and the proxy's
    listing (refresh_s 10 s here) still says serving when its next probe finds the worker asleep: it lists the
    workers again before giving the request up, and sees it draining. (Before, that probe pulled the request.)"""
    fleet = await start_fleet(tmp_path, num_workers=1, engine_kw=ENGINE, refresh_s=10.0)
    (x,) = fleet.sims
    try:
        task, _ = await _started(fleet)
        await asyncio.sleep(0.4)  # past the grace, and past the first probe (awake)
        verb = asyncio.create_task(fleet.op.lifecycle(x, "pause", mode="wait", clear_cache=False))
        status, h, raw = await asyncio.wait_for(task, 10.0)
        await verb
        probes = {o: fleet.proxy.metrics.probes.labels(x, o)._value.get() for o in ("asleep", "awake")}
        print(f"wait-pause with a stale listing: {status}, attempts {h.get('x-kvfleet-attempts')}; probes {probes}")
        assert status == 200 and h["x-kvfleet-attempts"] == "1", raw[:300]
        assert probes.get("asleep", 0) >= 1  # control: a probe did find it asleep while it drained
    finally:
        await fleet.op.lifecycle(x, "resume")
        await fleet.stop()


async def _index(fleet: Fleet, name: str) -> tuple[int, int]:
    """(blocks the controller indexes for the worker, its rank's epoch)."""
    ((blocks, epoch),) = [(r.num_blocks, r.epoch) for w in await fleet.op.workers() if w.name == name for r in w.ranks]
    return blocks, epoch


@pytest.mark.parametrize("drain_s", [5.0, 0.0])
async def test_a_wait_pause_longer_than_the_http_timeout_keeps_the_cache(tmp_path: Path, drain_s: float) -> None:
    """The drain outlasts the controller's HTTP timeout (2 s): the verb's call waits up to --reset-drain-timeout
    more, so the preserving pause (clear_cache=false) keeps the index and epoch. Control, drain 0 (the call bounded
    by the HTTP timeout alone, as before): the call fails at 2 s, the rank is listed error and its index dropped,
    and the SDK's retry, answered once the drain ends, leaves it paused/preserved but COLD (vLLM announces a
    block once)."""
    fleet = await start_fleet(tmp_path, num_workers=1, engine_kw=ENGINE, router_kw={"reset_drain_s": drain_s})
    (x,) = fleet.sims
    try:
        status, _, _ = await fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
        assert status == 200
        blocks, epoch = await until(lambda: _index(fleet, x), lambda be: be[0] > 0)
        task = asyncio.create_task(fleet.post("/v1/completions", {"model": MODEL, "prompt": "Long: " + PROMPT,
                                                                  "max_tokens": 300}))  # ~3 s
        await until(lambda: _running(fleet, x), bool, timeout=5.0)
        w = await fleet.op.lifecycle(x, "pause", mode="wait", clear_cache=False)
        status, h, raw = await task
        after = await _index(fleet, x)
        print(f"drain {drain_s}s: witness {w.phase}/{w.kv} epoch {w.epoch}; index {blocks} blocks epoch {epoch} -> "
              f"{after}; request {status}, attempts {h.get('x-kvfleet-attempts')}")
        assert (w.phase, w.kv) == ("paused", "preserved")
        if drain_s:
            assert status == 200, raw[:300]
            assert after[0] >= blocks and after[1] == epoch == w.epoch
        else:
            # NOTE: the request's answer is no part of the control. Each call of the verb fails at 2 s while vLLM still
            # drains, and from that failure until the SDK's retry (after its backoff) the rank is listed error, not
            # draining: a probe of the proxy in that gap finds the worker asleep with no verb in flight and gives the
            # request up (503), as before the drain wait. On a loaded machine the drain outlasted two calls and the
            # probe met the second gap ("asleep: no first byte after 4.52s"); a drain of 5 s does so on a quiet one.
            assert status == 200 or (status == 503 and b"(a worker asleep)" in raw), raw[:300]
            assert after[0] == 0 and after[1] > epoch
    finally:
        await fleet.op.lifecycle(x, "resume")
        await fleet.stop()


async def _running(fleet: Fleet, name: str) -> bool:
    return runs_a_request(fleet.sims[name])


async def test_control_a_keep_pause_still_fails_the_request_over(tmp_path: Path) -> None:
    """mode=keep freezes the request on the worker until a resume: the proxy gives it up and sends it elsewhere."""
    fleet = await start_fleet(tmp_path, num_workers=2, engine_kw=ENGINE)
    try:
        status, h, raw, x, w, _ = await _paused_under_a_request(fleet, "keep")
        other = next(n for n in fleet.sims if n != x)
        print(f"keep-pause under a request: {status} from {h.get('x-kvfleet-worker')} (paused {x}), attempts "
              f"{h.get('x-kvfleet-attempts')}")
        assert status == 200 and h["x-kvfleet-worker"] == other and h["x-kvfleet-attempts"] == "2", raw[:300]
        assert len(served(fleet.sims[other], "/v1/completions")) == 1
        assert (w.phase, w.serving) == ("paused", False)
    finally:
        await fleet.stop()


async def test_control_an_abort_pause_ends_the_request_on_the_worker(tmp_path: Path) -> None:
    """mode=abort: vLLM ends the request at once (finish_reason "abort"), and the worker is never listed draining."""
    fleet = await start_fleet(tmp_path, num_workers=1, engine_kw=ENGINE)
    (x,) = fleet.sims
    try:
        task, _ = await _started(fleet)
        phases: list[str] = []
        verb = asyncio.create_task(fleet.op.lifecycle(x, "pause", mode="abort", clear_cache=False))
        while not verb.done():
            phases.append(await _phase(fleet, x))
            await asyncio.sleep(0.05)
        status, h, raw = await asyncio.wait_for(task, 10.0)
        print(f"abort-pause under a request: {status}, attempts {h.get('x-kvfleet-attempts')}; "
              f"listed {sorted(set(phases))}")
        assert "draining" not in phases and (await verb).phase == "paused"
        if status == 200:  # the worker's own answer came first
            assert json.loads(raw)["choices"][0]["finish_reason"] == "abort"
        else:  # or the proxy found it asleep first: no worker left
            assert status == 503
    finally:
        await fleet.op.lifecycle(x, "resume")
        await fleet.stop()


async def test_a_sleep_with_mode_wait_lets_the_only_workers_request_finish_too(tmp_path: Path) -> None:
    """vLLM's sleep begins with the same pause: with mode=wait the requests in flight finish, then the cache is reset
    and the memory sleeps. Through the controller it is listed draining meanwhile, and the proxy waits for its answer
    (before: pulled, a 503 with no other worker)."""
    fleet = await start_fleet(tmp_path, num_workers=1, engine_kw=ENGINE)
    (x,) = fleet.sims
    try:
        task, _ = await _started(fleet)
        verb = asyncio.create_task(fleet.op.lifecycle(x, "sleep", level=1, mode="wait"))
        status, h, raw = await asyncio.wait_for(task, 10.0)
        w = await verb
        print(f"wait-sleep of the only worker under a request: {status}, attempts {h.get('x-kvfleet-attempts')}")
        assert status == 200 and h["x-kvfleet-attempts"] == "1" and h["x-kvfleet-worker"] == x, raw[:300]
        assert (w.phase, w.kv, w.serving) == ("sleeping", "forgotten", False)
        assert fleet.sims[x].engine.is_sleeping()
    finally:
        await fleet.op.lifecycle(x, "wake_up")
        await fleet.stop()
