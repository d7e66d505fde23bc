"""Fail over together: when one request's probe finds a worker asleep, or the controller stops listing it as
serving, every request still waiting for that worker's first byte fails over at once (one probe for all of
them), instead of each waiting out its own first-byte timeout and sending its own probe.

Real parts: a controller, three sim-vllm workers and the proxy (support/proxy_fleet.py); the worker is slept
behind the controller's back, so the route still names it and the requests really wait on it."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from support.proxy_fleet import BLOCK, MODEL, Fleet, served, start_fleet, until

PROMPT = "Plan the week's deliveries for the northern depot, stop by stop, with times. " * 3
BODY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}


async def _warm(fleet: Fleet) -> str:
    status, h, raw = await fleet.post("/v1/completions", BODY)
    assert status == 200, raw
    worker = h["x-kvfleet-worker"]
    n = json.loads(raw)["usage"]["prompt_tokens"]
    await until(lambda: fleet.blocks_known(worker), lambda k: k >= n // BLOCK)
    return worker


def _samples(fleet: Fleet, name: str) -> list[tuple[dict[str, str], float]]:
    text = fleet.proxy.metrics.render().decode()
    return [(s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == name]


async def _sleep_behind_its_back(fleet: Fleet, worker: str) -> None:
    async with fleet.http.post(fleet.sims[worker].url + "/sleep?level=1") as r:  # NOT through the controller
        assert r.status == 200


async def _timed_post(fleet: Fleet, delay_s: float) -> tuple[int, dict[str, str], float, float]:
    await asyncio.sleep(delay_s)
    t_sent = time.monotonic()
    status, h, raw = await fleet.post("/v1/completions", BODY)
    assert status == 200, raw
    return status, h, t_sent, time.monotonic()


async def test_one_probe_finding_a_sleeper_fails_over_every_request_waiting_on_it(tmp_path: Path) -> None:
    timeout_s, gap_s, n = 2.5, 0.5, 4  # the 4 sends span 1.5 s, all before the first one's probe (at 2.5 s)
    fleet = await start_fleet(tmp_path, reconcile_s=30.0, first_byte_timeout_s=timeout_s)  # the controller
    try:  # does not see the sleep during the test: only the proxy's probe can find it
        x = await _warm(fleet)
        await _sleep_behind_its_back(fleet, x)
        before = len(served(fleet.sims[x], "/v1/completions"))
        got = await asyncio.gather(*(_timed_post(fleet, i * gap_s) for i in range(n)))
        hit_x = served(fleet.sims[x], "/v1/completions")[before:]
        probes = [(s["observed"], v) for s, v in _samples(fleet, "kvfleet_proxy_sleep_probes_total")
                  if s["worker"] == x and v]
        retries = [(s["reason"], v) for s, v in _samples(fleet, "kvfleet_proxy_retries_total") if s["worker"] == x]
        failed_over = [(t_sent, t_done) for _, h, t_sent, t_done in got if h["x-kvfleet-attempts"] == "2"]
        last_sent, last_done = max(failed_over)
        print(f"{x} asleep: {len(hit_x)} of {n} staggered requests reached it; probes of it {probes}; "
              f"failovers {retries}; the last one to reach it answered {last_done - last_sent:.2f} s after its "
              f"send (its own probe would have come at {timeout_s} s)")
        assert all(h["x-kvfleet-worker"] != x for _, h, _, _ in got)
        assert len(hit_x) == len(failed_over) >= 3  # the window was exercised: they all waited on the sleeper
        assert all(s.disconnected for s in hit_x)  # every abandoned attempt was closed, not left queued
        assert probes == [("asleep", 1.0)]  # ONE probe for all of them (each probed for itself before)
        assert retries == [("asleep", float(len(hit_x)))]
        # the later ones failed over on the first one's finding, before their own timeout (a loose bound: the
        # earliest they could have probed for themselves)
        assert last_done - last_sent < timeout_s
    finally:
        await fleet.stop()


async def test_the_controller_stopping_to_list_a_worker_fails_over_its_waiters_after_one_probe(
        tmp_path: Path) -> None:
    timeout_s, n = 30.0, 4  # no request's own probe comes during the test
    fleet = await start_fleet(tmp_path, reconcile_s=30.0, first_byte_timeout_s=timeout_s)
    try:
        x = await _warm(fleet)
        await _sleep_behind_its_back(fleet, x)
        before = len(served(fleet.sims[x], "/v1/completions"))
        posts = [asyncio.create_task(_timed_post(fleet, 0.0)) for _ in range(n)]
        # the router spreads load, so some may go elsewhere: wait until each one waits on the sleeper or answered
        await until(lambda: _count(fleet, x), lambda k: k - before + sum(p.done() for p in posts) >= n)
        k = await _count(fleet, x) - before
        t_told = time.monotonic()
        w = await fleet.op.lifecycle(x, "sleep", level=1)  # now the controller knows (the sim's second sleep is
        assert not w.serving  # a no-op) and stops listing it as serving
        got = await asyncio.wait_for(asyncio.gather(*posts), timeout_s)
        probes = [(s["observed"], v) for s, v in _samples(fleet, "kvfleet_proxy_sleep_probes_total")
                  if s["worker"] == x and v]
        retries = [(s["reason"], v) for s, v in _samples(fleet, "kvfleet_proxy_retries_total") if s["worker"] == x]
        took = max(t_done for *_, t_done in got) - t_told
        print(f"{k} of {n} requests waited on {x}; the controller was told it slept; all answered elsewhere "
              f"{took:.2f} s later; probes of it {probes}; failovers {retries}")
        assert k >= 2  # the window was exercised
        assert all(h["x-kvfleet-worker"] != x for _, h, _, _ in got)
        assert sum(h["x-kvfleet-attempts"] == "2" for _, h, _, _ in got) == k
        assert probes == [("asleep", 1.0)] and retries == [("asleep", float(k))]
        assert took < timeout_s / 2  # loose: nowhere near their own first probe (at 30 s)
    finally:
        await fleet.stop()


async def _count(fleet: Fleet, worker: str) -> int:
    return len(served(fleet.sims[worker], "/v1/completions"))
