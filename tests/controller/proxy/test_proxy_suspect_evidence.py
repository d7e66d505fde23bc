"""A worker is skipped as suspect only on evidence that it is asleep or gone, or after several failures in a row:
one 503 or one lost connection from an awake worker costs that one attempt, not --suspect seconds of every
tenant's traffic to it.

Real parts: a controller, sim-vllm workers and the proxy (support/proxy_fleet.py). Each stand-in runs a small
middleware that answers a 503 to its next `fail_next` completions (a sidecar's or load balancer's blip), as a
test arms it; everything else is the stand-in's own answer."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from support.proxy_fleet import MODEL, Fleet, served, start_fleet

BODY = {"model": MODEL, "prompt": "Count the crates on the loading dock, row by row.", "max_tokens": 4}


def _fails_on_cue(sim: Any) -> Any:
    """The stand-in answers 503 to its next `sim.fail_next` completions, then serves as usual."""
    sim.fail_next = 0

    @web.middleware
    async def middleware(req: web.Request, handler: Any) -> web.StreamResponse:
        if req.path == "/v1/completions" and sim.fail_next > 0:
            sim.fail_next -= 1
            return web.json_response({"error": {"message": "upstream blip", "type": "ServiceUnavailableError",
                                                "param": None, "code": 503}}, status=503)
        return await handler(req)  # type: ignore[no-any-return]

    return middleware


def _probes(fleet: Fleet, worker: str) -> list[tuple[str, float]]:
    text = fleet.proxy.metrics.render().decode()
    return [(s.labels["observed"], s.value) for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "kvfleet_proxy_sleep_probes_total" and s.labels["worker"] == worker and s.value]


async def _is_sleeping(fleet: Fleet, worker: str) -> bool:
    async with fleet.http.get(fleet.sims[worker].url + "/is_sleeping") as r:
        return bool((await r.json())["is_sleeping"])


async def test_one_failure_of_each_awake_worker_does_not_take_the_model_down(tmp_path: Path) -> None:
    """The review's case: one blip on each of a model's two workers. Before, each failure marked its worker
    suspect, and every request of every tenant was refused 503 for --suspect seconds (30 here) unsent."""
    fleet = await start_fleet(tmp_path, num_workers=2, suspect_s=30.0, worker_middleware=_fails_on_cue)
    try:
        s, _, raw = await fleet.post("/v1/completions", BODY)
        assert s == 200, raw
        for sim in fleet.sims.values():
            sim.fail_next = 1  # type: ignore[attr-defined]
        s, _, raw = await fleet.post("/v1/completions", BODY)  # meets the blip on both workers
        assert s == 503, raw
        assert [len(served(sim, "/v1/completions")) for sim in fleet.sims.values()].count(0) == 0
        before = {n: len(served(sim, "/v1/completions")) for n, sim in fleet.sims.items()}
        got = await asyncio.gather(*(fleet.post("/v1/completions", {**BODY, "prompt": f"bravo {i}"}, who="b")
                                     for i in range(6)))
        sent = {n: len(served(sim, "/v1/completions")) - before[n] for n, sim in fleet.sims.items()}
        probes = {n: _probes(fleet, n) for n in fleet.sims}
        print(f"after one 503 on each worker: bravo's answers {[g[0] for g in got]}, sent per worker {sent}, "
              f"probes {probes}: {[g[2][:120] for g in got if g[0] != 200]}")
        assert [g[0] for g in got] == [200] * 6  # before: six 503s ("skipped (suspect)"), none sent
        assert sum(sent.values()) == 6
        assert not any(fleet.proxy.directory.is_suspect(n) for n in fleet.sims)
        assert probes == {n: [("awake", 1.0)] for n in fleet.sims}  # each failure was asked about, once
        assert not any([await _is_sleeping(fleet, n) for n in fleet.sims])  # control: they really are awake
    finally:
        await fleet.stop()


async def test_an_awake_worker_that_keeps_failing_is_skipped_after_three_in_a_row(tmp_path: Path) -> None:
    """What still marks an awake worker: cfg.suspect_after_failures (3) failed attempts in a row; an answer
    between them starts the count again."""
    fleet = await start_fleet(tmp_path, num_workers=1, suspect_s=30.0, worker_middleware=_fails_on_cue)
    try:
        (name, sim), = fleet.sims.items()

        async def one() -> tuple[int, int]:
            n = len(served(sim, "/v1/completions"))
            s, _, _ = await fleet.post("/v1/completions", BODY)
            return s, len(served(sim, "/v1/completions")) - n  # (the answer, how many sends reached the worker)

        sim.fail_next = 2  # type: ignore[attr-defined]
        two_then_ok = [await one() for _ in range(3)]
        sim.fail_next = 100  # type: ignore[attr-defined]
        failing = [await one() for _ in range(4)]
        print(f"2 blips then an answer: {two_then_ok}; then failing for good: {failing}")
        assert two_then_ok == [(503, 1), (503, 1), (200, 1)]  # not suspect after 2: the third was sent
        assert failing == [(503, 1), (503, 1), (503, 1), (503, 0)]  # the 4th was not sent: 3 in a row
        assert fleet.proxy.directory.is_suspect(name)
    finally:
        await fleet.stop()


def _resets_reused_connections(sim: Any) -> Any:
    """The stand-in closes the connection of its next `sim.resets_left` completions that arrive on a connection it
    has already served a request on, as a server closes an idle kept-alive connection (uvicorn's keep-alive
    timeout, 5 s) just as a pooled request arrives on it; `sim.reset_all` closes every completion's."""
    sim.resets_left, sim.reset_all = 0, False

    @web.middleware
    async def middleware(req: web.Request, handler: Any) -> web.StreamResponse:
        if req.path == "/v1/completions":
            reused = any(s.proto is req.protocol for s in sim.seen[:-1])  # the observer recorded this one last
            if sim.reset_all or (reused and sim.resets_left > 0):
                sim.resets_left -= 1
                assert req.transport is not None
                req.transport.abort()
                raise asyncio.CancelledError
        return await handler(req)  # type: ignore[no-any-return]

    return middleware


async def test_a_kept_alive_connection_closed_under_a_send_is_sent_again_on_a_fresh_one(tmp_path: Path) -> None:
    """One worker (so no runner-up hides the failure). Before, the lost connection failed the attempt and the
    request got a 503; now it is sent once more to the same worker on a fresh connection and answered."""
    fleet = await start_fleet(tmp_path, num_workers=1, suspect_s=30.0, worker_middleware=_resets_reused_connections)
    try:
        (name, sim), = fleet.sims.items()
        s, _, raw = await fleet.post("/v1/completions", BODY)  # leaves kept-alive connections in the proxy's pool
        assert s == 200, raw
        sim.resets_left = 1  # type: ignore[attr-defined]
        before = len(served(sim, "/v1/completions"))
        s, h, raw = await fleet.post("/v1/completions", BODY)
        sends = served(sim, "/v1/completions")[before:]
        print(f"a reused connection closed under the send: {s}, attempts {h.get('x-kvfleet-attempts')}, the worker got "
              f"{[x.outcome for x in sends]}: {raw[:120]!r}")
        assert [x.outcome for x in sends] == ["CancelledError", "ok"]  # the reset, then the fresh send
        assert s == 200 and h["x-kvfleet-attempts"] == "1"  # before: 503, no serving worker answered
        assert sum(x.proto is sends[0].proto for x in sim.seen) >= 2  # type: ignore[attr-defined]  # control: reused
        # once only: a worker that closes every connection (fresh ones too) is not sent the request a third time.
        # A new prompt: its /tokenize leaves a kept-alive connection in the pool (a repeated one's ids are cached)
        sim.reset_all = True  # type: ignore[attr-defined]
        before = len(served(sim, "/v1/completions"))
        s, _, _ = await fleet.post("/v1/completions", {**BODY, "prompt": "Now count the pallets."})
        sends = served(sim, "/v1/completions")[before:]
        assert s == 503 and len(sends) == 2 and sends[0].proto is not sends[1].proto
        assert not fleet.proxy.directory.is_suspect(name)  # one failed attempt of an awake worker
    finally:
        await fleet.stop()
