"""A prefix-cache reset through the controller drains a busy worker (vLLM refuses it while requests hold blocks);
the requests the proxy had sent there are answered there, once, whatever the proxy's probes find meanwhile.

The controller lists the worker "draining" while such a reset runs (fleet.core.lifecycle.lists_draining). It was
listed "unknown" (not serving), and a probe of the worker that did not answer in time (a loaded vLLM answers
/is_sleeping slowly; probe_timeout_s=1e-6 here makes every probe that) gave up the request it was finishing: sent
again to another worker from scratch (x-kvfleet-attempts 2), or a 503 on a model's only worker, whose reset then
"drained" in a moment, the request abandoned. A preempting reset (reset_running_requests=true) does not drain, but
its request too is answered where it ran (computed again), so it is listed draining as well (its window is short:
the listing's poll may miss it, so that is checked on the rule itself, tests/fleet/test_lifecycle_transitions.py).
Real parts: a controller, clocked sim-vllm workers (~10 ms a token), a proxy in front; the verb goes through the
SDK.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from support.proxy_fleet import MODEL, Fleet, served, sse_events, start_fleet, until

PROMPT = "Draft the release notes for the storage layer, one item per change. " * 2
ENGINE = {"time_scale": 1.0, "decode_base_s": 0.01}  # 200 tokens take ~2 s
SILENT_PROBES = {"probe_timeout_s": 1e-6}  # no probe answers in time: "busy", as a loaded vLLM's may be


async def _running(fleet: Fleet) -> str:
    async def poll() -> str | None:
        return next((n for n, s in fleet.sims.items() if s.engine.sched.in_flight()), None)

    return await until(poll, lambda n: n is not None, timeout=5.0)  # type: ignore[no-any-return]


async def _reset_under_a_request(fleet: Fleet, stream: bool, **kw: Any) -> tuple[int, dict[str, str], bytes, str,
                                                                                 Any, set[str]]:
    """A request through the proxy, running on its worker x, then x's reset while it runs: (the request's status,
    headers, body, x, the reset's witness, the phases x was listed in meanwhile)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "stream": stream}
    task = asyncio.create_task(fleet.post("/v1/completions", body))
    x = await _running(fleet)
    await asyncio.sleep(0.3)  # the proxy's first probes of it have come and gone (busy: it serves, so it waits)
    verb = asyncio.create_task(fleet.op.lifecycle(x, "reset_prefix_cache", **kw))
    phases: set[str] = set()
    while not (task.done() and verb.done()):
        phases |= {r.phase for w in await fleet.op.workers() if w.name == x for r in w.ranks}
        await asyncio.sleep(0.05)
    status, h, raw = await task
    return status, h, raw, x, await verb, phases


def _busy_probes(fleet: Fleet, x: str) -> float:
    return fleet.proxy.metrics.probes.labels(x, "busy")._value.get()  # type: ignore[no-any-return]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_draining_reset_answers_the_request_from_its_worker_once(tmp_path, stream: bool) -> None:
    fleet = await start_fleet(tmp_path, num_workers=2, engine_kw=ENGINE, **SILENT_PROBES)
    try:
        status, h, raw, x, w, phases = await _reset_under_a_request(fleet, stream)
        other = next(n for n in fleet.sims if n != x)
        print(f"draining reset, stream={stream}: {status} from {h.get('x-kvfleet-worker')} (reset {x}), attempts "
              f"{h.get('x-kvfleet-attempts')}; listed {sorted(phases)}; {_busy_probes(fleet, x):g} busy probes")
        assert status == 200 and h["x-kvfleet-worker"] == x and h["x-kvfleet-attempts"] == "1", raw[:300]
        assert served(fleet.sims[other], "/v1/completions") == []  # computed once (before: again on `other`)
        assert "draining" in phases and (w.phase, w.kv, w.serving) == ("serving", "forgotten", True)
        if stream:
            assert sse_events(raw)[-1] == "[DONE]"
        else:
            assert _busy_probes(fleet, x) >= 1  # control: a probe did go unanswered while it drained
            assert json.loads(raw)["choices"][0]["finish_reason"] == "length"
    finally:
        await fleet.stop()


async def test_a_draining_reset_of_the_only_worker_waits_for_its_request(tmp_path) -> None:
    """Before: a 503, the request abandoned on the worker, and the reset went through at once, having waited for
    nothing. Now the reset waits for the request, which ends whole."""
    fleet = await start_fleet(tmp_path, num_workers=1, engine_kw=ENGINE, **SILENT_PROBES)
    try:
        status, h, raw, x, w, phases = await _reset_under_a_request(fleet, stream=False)
        (seen,) = served(fleet.sims[x], "/v1/completions")
        print(f"draining reset of the only worker: {status}, attempts {h.get('x-kvfleet-attempts')}; listed "
              f"{sorted(phases)}; the worker's request {seen.outcome}, client gone {seen.disconnected}")
        assert status == 200 and h["x-kvfleet-attempts"] == "1", raw[:300]
        assert seen.outcome == "ok" and not seen.disconnected
        assert (w.kv, w.serving) == ("forgotten", True)
        assert fleet.ctl.ctx.metrics.reset_drains.labels("reset")._value.get() == 1  # it drained, then reset
    finally:
        await fleet.stop()


async def test_a_preempting_reset_answers_its_request_where_it_ran(tmp_path) -> None:
    """reset_running_requests=true: vLLM preempts the request and computes it again; no drain, and the request is
    answered where it ran."""
    fleet = await start_fleet(tmp_path, num_workers=2, engine_kw=ENGINE, **SILENT_PROBES)
    try:
        status, h, raw, x, w, phases = await _reset_under_a_request(fleet, False, reset_running_requests=True)
        print(f"preempting reset: {status} from {h.get('x-kvfleet-worker')} (reset {x}), attempts "
              f"{h.get('x-kvfleet-attempts')}; listed {sorted(phases)}")
        assert status == 200 and h["x-kvfleet-worker"] == x and h["x-kvfleet-attempts"] == "1", raw[:300]
        assert (w.kv, w.serving) == ("forgotten", True)
        assert fleet.sims[x].engine.preempted_prefill > 0
    finally:
        await fleet.stop()
