"""SIGTERM to a real `kvfleet proxy` with two streams in flight: /ready answers 503 at once, new connections are
still taken for --shutdown-delay, then the listener closes; the stream that ends within --shutdown-drain ends
whole, the one that would not is cut at the drain limit, and the process exits 0.

NOTE: before, SIGTERM closed the listening socket at once (aiohttp's cleanup): /ready never answered 503, a
connection opened in the instant after SIGTERM was refused while endpoints still named the pod, and requests in
flight were waited on for aiohttp's 60 s default, twice over (a stream outlives aiohttp's first cancel), whatever
the pod's grace period.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp

from controller.router import RouterConfig
from fleet.app.testkit.stack import StackConfig, start_stack

ROOT = Path(__file__).resolve().parents[3]
DELAY_S, DRAIN_S = 1.0, 4.0
CUT_S = 3.0  # the most a cut may take past the drain (controller/proxy/server.py CUT_GRACE_S, twice), and slack
SHORT, LONG = 200, 3000  # tokens: about 1.6 s and 25 s at the sim's ~8 ms per decode step; the short one must end
# between DELAY_S and DELAY_S + DRAIN_S after the signal: on a loaded machine (load 17 on 2 cores) decode steps took
# ~14 ms, and 250 tokens within a 2.5 s drain fell 4 tokens short of it


def _start_proxy(controller: str, token: str) -> tuple[subprocess.Popen[str], str, list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleet.app.cli.main", "proxy", "--controller", controller, "--listen", "127.0.0.1:0",
         "--shutdown-delay", str(DELAY_S), "--shutdown-drain", str(DRAIN_S)],
        cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1", KVFLEET_PROXY_TOKEN=token), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    seen: list[str] = []
    for line in proc.stdout:
        seen.append(line)
        if "kvfleet proxy listening on" in line:
            threading.Thread(target=lambda: seen.extend(proc.stdout or ()), daemon=True).start()
            return proc, line.split("listening on ")[1].split(" ")[0], seen
    raise AssertionError("the proxy did not start: " + "".join(seen))


async def _get(url: str) -> int | str:
    """GET on a new connection (a pooled one would not show whether the proxy still accepts)."""
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
                s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status
    except aiohttp.ClientConnectorError:
        return "refused"


async def _stream(http: aiohttp.ClientSession, url: str, hdr: dict[str, str], n: int,
                  first: asyncio.Event) -> dict[str, Any]:
    body = {"model": "sim-model", "prompt": "hello " * 20, "max_tokens": n, "stream": True, "ignore_eos": True}
    chunks, done, error = 0, False, None
    try:
        async with http.post(url + "/v1/completions", json=body, headers=hdr) as r:
            assert r.status == 200
            async for line in r.content:
                done = done or line.strip() == b"data: [DONE]"
                chunks += line.startswith(b"data: {")
                first.set()
    except aiohttp.ClientError as e:
        error = type(e).__name__
    return {"chunks": chunks, "done": done, "error": error, "ended": time.monotonic()}


async def test_sigterm_turns_ready_503_keeps_accepting_then_drains(tmp_path: Path) -> None:
    stack = await start_stack(StackConfig(
        store_url=f"sqlite:///{tmp_path / 'kv.db'}", state_dir=str(tmp_path), workers=1, num_blocks=1024,
        engine={"time_scale": 1.0}, tenants=("acme",), sessions=False, metrics=True,
        router=RouterConfig(reconcile_interval_s=0.5)))
    proc = None
    http = aiohttp.ClientSession()
    try:
        proc, url, log = await asyncio.to_thread(_start_proxy, stack.ctl.address, stack.operator_token)
        for _ in range(100):
            if await _get(url + "/ready") == 200:
                break
            await asyncio.sleep(0.1)
        hdr = {"Authorization": f"Bearer {stack.tenant_token}"}
        started = [asyncio.Event(), asyncio.Event()]
        streams = [asyncio.create_task(_stream(http, url, hdr, n, e))
                   for n, e in zip((SHORT, LONG), started, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 20)

        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        ready = await _get(url + "/ready")
        while ready == 200 and time.monotonic() < t0 + DELAY_S:  # until the proxy has taken the signal (a fixed
            await asyncio.sleep(0.05)                             # 0.2 s can fall short on a loaded machine)
            ready = await _get(url + "/ready")
        during = [ready, await _get(url + "/health")]  # within the delay: 503, and accepted
        await asyncio.sleep(max(0.0, t0 + DELAY_S + 0.5 - time.monotonic()))
        after = await _get(url + "/health")  # past the delay: the listener is closed
        while after != "refused" and time.monotonic() < t0 + DELAY_S + 5.0:  # (the delay began when it took the signal)
            await asyncio.sleep(0.1)
            after = await _get(url + "/health")
        short, long = await asyncio.gather(*streams)
        rc = await asyncio.to_thread(proc.wait, 20)
        exited = time.monotonic() - t0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        await http.close()
        await stack.stop()
    for s in (short, long):
        s["ended"] -= t0
    print(f"during delay {during}, after {after}; short {short}; long {long}; "
          f"exit {rc} after {exited:.1f}s\n" + "".join(log[-3:]))
    assert during == [503, 200] and after == "refused"
    assert short["done"] and short["chunks"] >= SHORT and short["error"] is None  # whole ..
    assert short["ended"] > DELAY_S  # .. though still running when the listener closed: drained
    assert not long["done"] and 0 < long["chunks"] < LONG  # cut at the drain limit, not run to its end ..
    assert DELAY_S + DRAIN_S - 0.5 <= long["ended"] <= DELAY_S + DRAIN_S + CUT_S  # .. there
    assert rc == 0 and any("accepting for 1s more" in line for line in log)
