"""Sleep through the controller: the worker gets nothing. Sleep behind its back: at most one failed
attempt per request until the controller's reconcile loop sees it, and every request succeeds elsewhere."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support.dying_worker import die_after
from support.proxy_fleet import BLOCK, MODEL, Fleet, served, start_fleet, until

PROMPT = "Summarise the quarterly report for the board, section by section, with numbers. " * 3


async def _warm(fleet: Fleet) -> str:
    """One completion through the proxy; wait until the controller indexed its blocks; return the worker."""
    status, h, raw = await fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
    assert status == 200, raw
    worker = h["x-kvfleet-worker"]
    n = json.loads(raw)["usage"]["prompt_tokens"]
    await until(lambda: fleet.blocks_known(worker), lambda k: k >= n // BLOCK)
    return worker


async def _hangs(url: str, timeout: float = 0.6) -> bool:
    """Control: a request straight to the worker; True if it hangs (a sleeping vLLM queues it)."""
    try:
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 1}, timeout=aiohttp.ClientTimeout(total=timeout)):
            return False
    except TimeoutError:
        return True


async def test_sleep_through_the_controller_sends_it_nothing(fleet: Fleet) -> None:
    x = await _warm(fleet)
    w = await fleet.op.lifecycle(x, "sleep", level=1)
    assert not w.serving
    await until(lambda: _health(fleet), lambda h: h["serving"] == 2)  # the proxy's directory caught up
    before = len(served(fleet.sims[x]))
    bodies = [("/v1/completions", {"prompt": PROMPT, "max_tokens": 4}),
              ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "stream": True}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True})]
    got = await asyncio.gather(*(fleet.post(p, {"model": MODEL, **b}) for p, b in bodies * 3))
    workers = sorted({h["x-kvfleet-worker"] for _, h, _ in got})
    print(f"slept {x} through the controller (witness {w.phase}/{w.kv}); 12 requests went to {workers}; "
          f"{x} received {len(served(fleet.sims[x])) - before} proxied requests")
    assert all(s == 200 and h["x-kvfleet-attempts"] == "1" for s, h, _ in got)
    assert x not in workers and len(served(fleet.sims[x])) == before
    assert _sum(fleet, "kvfleet_proxy_retries_total") == 0
    assert await _hangs(fleet.sims[x].url)  # control: the worker really is asleep (a request to it hangs)
    for name in fleet.sims:  # all asleep: the proxy answers 503 itself and stays up
        await fleet.op.lifecycle(name, "sleep", level=1)
    status, h, raw = await fleet.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert status == 503 and h.get("Retry-After") == "1"
    assert json.loads(raw)["error"]["type"] == "ServiceUnavailableError"


async def test_sleep_behind_the_controllers_back_costs_at_most_one_attempt(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, reconcile_s=3.0)  # a wide detection window, on purpose
    try:
        x = await _warm(fleet)
        async with fleet.http.post(fleet.sims[x].url + "/sleep?level=1") as r:  # NOT through the controller
            assert r.status == 200
        before = len(served(fleet.sims[x], "/v1/completions"))
        burst = await asyncio.gather(*(fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPT,
                                                                      "max_tokens": 4}) for _ in range(6)))
        later = [await fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
                 for _ in range(4)]
        hit_x = served(fleet.sims[x], "/v1/completions")[before:]
        attempts = [int(h["x-kvfleet-attempts"]) for _, h, _ in burst + later]
        retries, skips = _sum(fleet, "kvfleet_proxy_retries_total"), _sum(fleet, "kvfleet_proxy_skipped_workers_total")
        print(f"{x} slept behind the controller's back: attempts per request {attempts}; failed attempts {retries} "
              f"for {len(attempts)} requests; skipped as suspect {skips}; {x} got {len(hit_x)} proxied requests, "
              f"all abandoned by the proxy: {all(s.disconnected for s in hit_x)}")
        assert all(s == 200 and h["x-kvfleet-worker"] != x for s, h, _ in burst + later)
        assert all(a <= 2 for a in attempts) and retries == len(hit_x) <= len(attempts)
        assert len(hit_x) >= 1  # the window was really exercised: the controller still chose the sleeper
        assert all(s.disconnected for s in hit_x)  # every abandoned attempt was closed, not left queued
        assert await _hangs(fleet.sims[x].url)  # control: without the proxy's failover the request hangs
        # once the controller's reconcile loop sees the sleep, the proxy does not even try it
        await until(fleet.op.workers, lambda ws: not next(w for w in ws if w.name == x).serving)
        s, h, _ = await fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        assert s == 200 and h["x-kvfleet-worker"] != x and h["x-kvfleet-attempts"] == "1"
    finally:
        await fleet.stop()


async def test_a_failover_never_goes_to_a_worker_the_controller_slept_after_the_route(tmp_path: Path) -> None:
    """The chosen worker x is asleep behind the controller's back; while the proxy waits for its first byte, the
    controller sleeps the runner-up y. The proxy's listing (refreshed every 30 s here) still shows y serving, so
    it used to fail over to y, which held the request until the proxy gave up on it too. Now the proxy tells the
    controller of the move before the send, the controller answers that y is not serving, and y gets nothing."""
    fleet = await start_fleet(tmp_path, num_workers=2, reconcile_s=30.0, refresh_s=30.0, first_byte_timeout_s=0.5)
    try:
        x = await _warm(fleet)
        y = next(n for n in fleet.sims if n != x)
        async with fleet.http.post(fleet.sims[x].url + "/sleep?level=1") as r:  # NOT through the controller
            assert r.status == 200
        before = len(served(fleet.sims[y], "/v1/completions"))
        req = asyncio.create_task(fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}))
        async def sent_to_x() -> int:
            return len(served(fleet.sims[x], "/v1/completions"))

        await until(sent_to_x, lambda n: n >= 2)  # the request reached x (the first was _warm's)
        w = await fleet.op.lifecycle(y, "sleep", level=1)  # through the controller, while x is waited for
        assert not w.serving
        s, _, raw = await req
        got = served(fleet.sims[y], "/v1/completions")[before:]
        print(f"x={x} asleep behind the back, y={y} slept by the controller: answer {s}, y got {len(got)}: {raw[:160]!r}")
        assert got == [] and s == 503 and b"not serving, the controller says" in raw  # before: y got the request
    finally:
        await fleet.stop()


async def test_a_woken_worker_is_no_longer_skipped_once_the_controller_has_seen_it_wake(tmp_path: Path) -> None:
    """The proxy finds x asleep behind the controller's back and skips it (suspect_s, 30 s here). Once the
    controller has itself seen the sleep and the wake (x serving again under a newer epoch), the proxy's
    mark is dropped: the controller's choices route to x again. Before issue #27's fix the mark held for
    the whole suspect_s, and every route the controller sent to the woken worker went to a runner-up."""
    fleet = await start_fleet(tmp_path, reconcile_s=1.0, suspect_s=30.0)
    try:
        x = await _warm(fleet)
        epoch = max(r.epoch for r in next(w for w in await fleet.op.workers() if w.name == x).ranks)
        async with fleet.http.post(fleet.sims[x].url + "/sleep?level=1") as r:  # NOT through the controller
            assert r.status == 200
        s, h, _ = await fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        assert s == 200 and h["x-kvfleet-worker"] != x
        assert fleet.proxy.directory.is_suspect(x)  # control: the proxy found it asleep and marks it
        await until(fleet.op.workers, lambda ws: not next(w for w in ws if w.name == x).serving)
        async with fleet.http.post(fleet.sims[x].url + "/wake_up") as r:  # still behind its back
            assert r.status == 200
        ws = await until(fleet.op.workers, lambda ws: next(w for w in ws if w.name == x).serving)
        assert max(r.epoch for r in next(w for w in ws if w.name == x).ranks) > epoch
        # the proxy's directory lists the new epoch (polled: a fixed 3 refreshes can fall short on a loaded machine)
        await until(lambda: asyncio.sleep(0, (fleet.proxy.directory.is_suspect(x), fleet.proxy.directory.serving(x))),
                    lambda v: v == (False, True))
        assert not fleet.proxy.directory.is_suspect(x)
        assert fleet.proxy.directory.serving(x)
    finally:
        await fleet.stop()


async def test_a_mark_made_after_the_controller_saw_the_sleep_is_dropped_at_the_wake(tmp_path: Path) -> None:
    """As the previous test, but the proxy judges its failed attempt (routed before the sleep) only after the
    controller has seen the sleep and its listing says x is not serving, under the new epoch. The mark used to take
    that new epoch, which the wake keeps: the controller routed to the woken x under it and the proxy skipped x for
    the rest of suspect_s (a routing bench run of agents16x4/very-tight: 45 skips, 1.7x the prefill)."""
    fleet = await start_fleet(tmp_path, reconcile_s=0.2, refresh_s=0.1, suspect_s=30.0)
    try:
        x = await _warm(fleet)
        routed = max(r.epoch for r in next(w for w in await fleet.op.workers() if w.name == x).ranks)
        async with fleet.http.post(fleet.sims[x].url + "/sleep?level=1") as r:  # NOT through the controller
            assert r.status == 200
        await until(fleet.op.workers, lambda ws: not next(w for w in ws if w.name == x).serving)
        await until(lambda: _listed(fleet, x), lambda w: w is not None and not w.serving)
        fleet.proxy.directory.suspect(x, routed)   # the attempt routed under the old epoch, judged only now
        assert fleet.proxy.directory.is_suspect(x)  # control: marked while asleep
        async with fleet.http.post(fleet.sims[x].url + "/wake_up") as r:  # still behind its back
            assert r.status == 200
        await until(lambda: _listed(fleet, x), lambda w: w is not None and w.serving)
        listed = await _listed(fleet, x)
        assert listed is not None and max(r.epoch for r in listed.ranks) > routed
        assert not fleet.proxy.directory.is_suspect(x)   # before: skipped for 30 s
        s, h, _ = await fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        assert s == 200 and h["x-kvfleet-attempts"] == "1"
    finally:
        await fleet.stop()


async def _listed(fleet: Fleet, name: str) -> Any:
    return fleet.proxy.directory.workers.get(name)


async def _health(fleet: Fleet) -> dict:
    async with fleet.http.get(fleet.proxy.url + "/health") as r:
        return await r.json()


def _sum(fleet: Fleet, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = fleet.proxy.metrics.render().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


async def test_paused_or_dead_worker_costs_at_most_one_attempt(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, reconcile_s=3.0)
    try:
        x = await _warm(fleet)
        async with fleet.http.post(fleet.sims[x].url + "/pause?mode=abort") as r:  # vLLM answers 503 while paused
            assert r.status == 200
        paused = [await fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
                  for _ in range(3)]
        print("paused behind the back -> attempts", [h["x-kvfleet-attempts"] for _, h, _ in paused])
        assert all(s == 200 and h["x-kvfleet-worker"] != x for s, h, _ in paused)
        assert [h["x-kvfleet-attempts"] for _, h, _ in paused] == ["2", "1", "1"]  # then skipped as suspect
        async with fleet.http.post(fleet.sims[x].url + "/resume") as r:
            assert r.status == 200
        fleet.proxy.directory.marks.forget(x)
        # a dead worker: connection refused
        y = next(n for n in fleet.sims if n != x)
        await fleet.sims.pop(y).stop()  # the controller still lists it as serving
        got = await asyncio.gather(*(fleet.post("/v1/completions", {"model": MODEL, "prompt": f"{PROMPT} {i}",
                                                                    "max_tokens": 2}) for i in range(6)))
        assert all(s == 200 for s, _, _ in got), [b[:300] for s, _, b in got if s != 200]
        attempts = [int(h["x-kvfleet-attempts"]) for _, h, _ in got]
        print(f"{y} dead -> served by", sorted({h["x-kvfleet-worker"] for _, h, _ in got}), "attempts", attempts)
        assert all(s == 200 and h["x-kvfleet-worker"] != y for s, h, _ in got)
        assert all(a <= 2 for a in attempts)
    finally:
        await fleet.stop()


def _dies_on_cue(sim: Any) -> Any:
    """A worker that, asked with X-Request-Id "die-stream" or "die-length", starts its answer and dies mid-way."""
    from aiohttp import web

    @web.middleware
    async def middleware(req: web.Request, handler: Any) -> web.StreamResponse:
        cue = req.headers.get("X-Request-Id", "")
        if req.path != "/v1/completions" or cue not in ("die-stream", "die-length"):
            return await handler(req)  # type: ignore[no-any-return]
        sse = cue == "die-stream"
        headers = {"Content-Type": "text/event-stream"} if sse else {"Content-Type": "application/json",
                                                                     "Content-Length": "1000"}
        return await die_after(req, headers, b'data: {"choices": [{"text": "t0"}]}\n\n' if sse else b'{"id": "x", "choices": [')

    return middleware


async def test_an_answer_the_worker_breaks_off_ends_clearly_and_at_once(tmp_path: Path) -> None:
    """NOTE: the worker's break went up to the error middleware, whose fresh 500 response aiohttp wrote into the
    answer already under way: a status line inside the stream (curl: illegal chunked encoding), then a wait for
    the keep-alive timeout (30 s). Now a stream ends with an OpenAI-shaped error event and [DONE]; any other
    answer's connection is cut at once, short of its announced length."""
    fleet = await start_fleet(tmp_path, num_workers=1, worker_middleware=_dies_on_cue)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    try:
        t0 = time.monotonic()
        async with fleet.http.post(fleet.proxy.url + "/v1/completions", json={**body, "stream": True},
                                   headers={**fleet.headers(), "X-Request-Id": "die-stream"},
                                   timeout=aiohttp.ClientTimeout(total=10)) as r:
            status, raw = r.status, await r.read()
        stream_s = time.monotonic() - t0
        events = [e for e in raw.decode().split("\n\n") if e]
        print(f"stream: {status} in {stream_s:.2f} s: {events}")
        assert status == 200 and events[0] == 'data: {"choices": [{"text": "t0"}]}' and events[-1] == "data: [DONE]"
        err = json.loads(events[-2].removeprefix("data: "))["error"]
        assert err["code"] == 502 and "broke off its answer" in err["message"] and stream_s < 5
        t0 = time.monotonic()
        with pytest.raises(aiohttp.ClientPayloadError):
            async with fleet.http.post(fleet.proxy.url + "/v1/completions", json=body,
                                       headers={**fleet.headers(), "X-Request-Id": "die-length"},
                                       timeout=aiohttp.ClientTimeout(total=10)) as r:
                await r.read()
        print(f"length-announced answer cut after {time.monotonic() - t0:.2f} s")
        assert time.monotonic() - t0 < 5  # before: a 500 inside the body, then the keep-alive wait
        s, _, _ = await fleet.post("/v1/completions", body)
        assert s == 200  # control: the worker answers otherwise
    finally:
        await fleet.stop()
