"""Edge hardening of the proxy (#13): a busy worker is not called asleep; hostile bodies and slow clients
get a clear answer (or a closed connection) instead of a 500 or a held socket."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from support.proxy_fleet import LONG_CONTEXT, MODEL, served, start_fleet, until

PROMPT = "Draft the incident review for the storage outage, with a timeline and the follow-ups."


def _samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name}


async def test_a_probe_that_times_out_means_busy_not_asleep(tmp_path: Path) -> None:
    # One clocked worker (a long non-streaming answer sends no byte for ~0.3 s) whose /is_sleeping never answers
    # within the probe timeout: what a vLLM under load looks like. It is busy, not asleep: the request waits.
    fleet = await start_fleet(tmp_path, num_workers=1, engine_kw={"time_scale": 1.0},
                              first_byte_timeout_s=0.05, probe_timeout_s=1e-6)
    try:
        (name, sim), = fleet.sims.items()
        status, h, raw = await fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 30})
        probes = _samples(fleet.proxy.metrics.render().decode(), "kvfleet_proxy_sleep_probes_total")
        print(f"busy worker, probe timing out: status {status}, attempts {h.get('x-kvfleet-attempts')}, "
              f"probes {probes}")
        assert status == 200, raw  # before: 503 "asleep: no first byte ... and /is_sleeping says so"
        assert h["x-kvfleet-worker"] == name and h["x-kvfleet-attempts"] == "1"
        assert json.loads(raw)["usage"]["completion_tokens"] == 30
        assert probes.get((("observed", "busy"), ("worker", name)), 0) >= 1  # the probe really timed out
        assert not fleet.proxy.directory.is_suspect(name)
        assert len(served(sim, "/v1/completions")) == 1
    finally:
        await fleet.stop()


async def _raw(fleet_port: int, data: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    r, w = await asyncio.open_connection("127.0.0.1", fleet_port)
    w.write(data)
    await w.drain()
    return r, w


async def test_slow_clients_are_cut_off(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, num_workers=1, client_header_timeout_s=0.3, client_body_timeout_s=0.3)
    try:
        port, auth = fleet.proxy.port, f"Authorization: Bearer {fleet.tokens['a']}\r\n"
        # headers that never end (slowloris): the proxy closes the connection
        r, w = await _raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nX-Slow: 1\r\n")
        closed = await asyncio.wait_for(r.read(), 5.0)  # before: held open (aiohttp's default is an hour)
        w.close()
        # a body that never completes: 408 with an OpenAI-style error
        r, w = await _raw(port, (f"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\n{auth}"
                                 "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode()
                          + b'{"model": "sim-model", "prompt": "')
        answer = await asyncio.wait_for(r.readuntil(b"}}"), 5.0)  # before: waits for the body forever
        t0 = asyncio.get_running_loop().time()
        rest = await asyncio.wait_for(r.read(), 20.0)  # the connection closes after the 408
        closed_after = asyncio.get_running_loop().time() - t0
        w.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        print(f"trickled headers -> connection closed ({closed!r}); stalled body -> {head.splitlines()[0]!r} "
              f"{body[-160:]!r}, connection closed {closed_after:.2f} s after it")
        assert closed == b""
        assert rest == b"" and closed_after < 2.0, closed_after  # before: 10 s later (aiohttp's lingering time)
        assert head.startswith(b"HTTP/1.1 408")
        assert b'"RequestTimeoutError"' in body and b"client body timeout" in body
        # control: a prompt client on a fresh connection is served
        status, _, _ = await fleet.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert status == 200
    finally:
        await fleet.stop()


async def test_a_client_reset_mid_answer_is_not_a_500(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: aiohttp cancels the handler when the client goes away, but a write can fail first (the reset seen
    # while writing, before connection_lost runs). Handler cancellation off makes every reset take that path.
    init = web.AppRunner.__init__

    def no_cancellation(self: web.AppRunner, app: web.Application, **kw: Any) -> None:
        init(self, app, **{**kw, "handler_cancellation": False})

    monkeypatch.setattr(web.AppRunner, "__init__", no_cancellation)
    fleet = await start_fleet(tmp_path, num_workers=1, engine_kw=LONG_CONTEXT)
    caplog.set_level(logging.INFO, logger="kvfleet.proxy")
    try:
        for stream in (True, False, True, False):
            body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 20000, "stream": stream}).encode()
            r, w = await _raw(fleet.proxy.port, (
                f"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer {fleet.tokens['a']}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
            await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10.0)  # the answer has begun
            w.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            w.transport.abort()  # RST: the client is gone mid-answer
            await until(lambda: _now(_samples(fleet.proxy.metrics.render().decode(),
                                              "kvfleet_proxy_client_disconnects_total")),
                        lambda m: sum(m.values()) >= 1)
        text = fleet.proxy.metrics.render().decode()
        errors = [r for r in caplog.records if r.name == "kvfleet.proxy" and r.levelno >= logging.WARNING]
        gone = sum(_samples(text, "kvfleet_proxy_client_disconnects_total").values())
        print(f"4 client resets mid-answer: {gone:g} counted as disconnects; errors by status "
              f"{_samples(text, 'kvfleet_proxy_errors_total')}; proxy log warnings/errors: "
              f"{[r.getMessage()[:80] for r in errors]}")
        assert gone >= 1  # the path was really exercised
        assert errors == []  # before: "proxy: POST /v1/completions failed" with a traceback, counted as a 500
        assert not _samples(text, "kvfleet_proxy_errors_total")
        status, _, _ = await fleet.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert status == 200
    finally:
        await fleet.stop()


async def _now(x: object) -> object:
    return x


async def test_a_silent_worker_the_controller_stops_serving_is_given_up(tmp_path: Path) -> None:
    # Busy is the benefit of the doubt, not a promise to wait forever. A worker slept behind the controller's
    # back queues our request and (here) never answers the probe in time; once the controller's reconcile
    # stops listing it as serving, the proxy gives up on it instead of waiting on it forever.
    fleet = await start_fleet(tmp_path, num_workers=1, first_byte_timeout_s=0.1, probe_timeout_s=1e-6)
    try:
        (name, sim), = fleet.sims.items()
        async with fleet.http.post(sim.url + "/sleep?level=1") as r:  # NOT through the controller
            assert r.status == 200
        status, h, raw = await asyncio.wait_for(
            fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}), 30.0)
        err = json.loads(raw)["error"]["message"]
        print(f"{name} asleep behind the controller's back, probe silent -> {status}: {err}")
        assert status == 503 and "unresponsive" in err and "no longer lists it as serving" in err  # before: hung
        assert len(served(sim, "/v1/completions")) == 1 and served(sim, "/v1/completions")[0].disconnected
    finally:
        await fleet.stop()


async def test_a_worker_that_never_sends_a_first_byte_is_given_up_after_the_overall_bound(tmp_path: Path) -> None:
    # A clocked worker whose answer is far off and whose /is_sleeping never answers in time, while the controller
    # keeps listing it as serving: every probe says "busy". Without an overall bound the proxy waited on it for as
    # long as the worker took (forever for a dead engine behind a live socket); with max_first_byte_wait_s it
    # gives the attempt up.
    fleet = await start_fleet(tmp_path, num_workers=1, engine_kw={"time_scale": 1.0},
                              first_byte_timeout_s=0.05, probe_timeout_s=1e-6, max_first_byte_wait_s=0.5)
    try:
        (name, sim), = fleet.sims.items()
        status, _, raw = await asyncio.wait_for(
            fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 5000}), 20.0)
        err = json.loads(raw)["error"]["message"]
        assert status == 503 and "a worker sent no first byte within the proxy's limit" in err, (status, err)
        assert name not in err  # the worker's name and the limit's flag went to the log (test_proxy_error_detail.py)
        assert served(sim, "/v1/completions")[0].disconnected  # the worker learnt the request was dropped
    finally:
        await fleet.stop()
