"""Crashes, not graceful stops, for the proxy: SIGKILL `kvfleet proxy` with requests in flight
(issue #13, crash tests).

The proxy tracks each route it asks for and releases it when the request ends; a killed proxy
releases nothing. The router must drop those phantom routes (the worker's /metrics shows them
gone), so placement is not skewed forever, and a new proxy serves at once. No WARM answer may
name a worker that is not serving, and no request may hang.
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

import aiohttp

from controller.config import ControllerConfig
from controller.metrics import Metrics
from controller.router import RouterConfig, WorkerSpec
from controller.server import build_server
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm

ROOT = Path(__file__).resolve().parents[2]
MODEL = "m"


def _start_proxy(controller: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "fleet.app.cli.main", "proxy", "--controller", controller,
                             "--listen", "127.0.0.1:0"], cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "kvfleet proxy listening on" in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
            return proc, line.split("listening on ")[1].split(" ")[0]
    raise AssertionError("the proxy did not start: " + "".join(seen))


async def test_proxy_sigkill_with_requests_in_flight(tmp_path: Path) -> None:
    sims = [await SimVllm(SimConfig(engine=SimEngineConfig(model=MODEL, num_blocks=256, time_scale=1.0)))
            .start() for _ in range(2)]
    ctl = await build_server(ControllerConfig(listen="127.0.0.1:0", store_url=f"sqlite:///{tmp_path}/kv.db"),
                             metrics=Metrics(), router_config=RouterConfig(reconcile_interval_s=0.1))
    router = ctl.ctx.router
    assert router is not None
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
    proc = None
    errors: list[str] = []
    stale = warm = 0
    try:
        for i, s in enumerate(sims):
            await router.register_worker(WorkerSpec(f"w{i}", s.url, s.kv_events, s.replay, MODEL))
        proc, url = await asyncio.to_thread(_start_proxy, ctl.address)

        async def ask(k: int, turn: int, strict: bool, max_tokens: int = 4) -> None:
            nonlocal stale, warm
            prompt = f"agent {k} " + " ".join(f"step{j}" for j in range(40 + turn))
            try:
                async with http.post(url + "/v1/completions",
                                     json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}")
                    if r.headers.get("x-kvfleet-verdict") == "WARM":
                        warm += 1
                        w = sims[int(r.headers["x-kvfleet-worker"][1:])]
                        async with http.get(w.url + "/sim/cache") as t:
                            stale += int(not (await t.json())["serving"])
            except (aiohttp.ClientError, RuntimeError, TimeoutError) as e:
                if strict:
                    errors.append(f"agent {k} turn {turn}: {type(e).__name__}: {e}")

        for turn in range(3):
            await asyncio.gather(*(ask(k, turn, True) for k in range(4)))
        # SIGKILL with 8 requests in flight (their failures are the crash, not swallowed errors)
        busy = [asyncio.create_task(ask(k, 3, False, max_tokens=200)) for k in range(8)]
        for _ in range(200):
            if len(router.flights) >= 4:
                break
            await asyncio.sleep(0.01)
        at_kill = len(router.flights)
        proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 30)
        await asyncio.gather(*busy)
        proc, url = await asyncio.to_thread(_start_proxy, ctl.address)
        for turn in range(4, 7):
            await asyncio.gather(*(ask(k, turn, True) for k in range(4)))
        t_drop = time.monotonic()
        for _ in range(200):  # the dead proxy's routes were never released: the router drops them
            if not router.flights:
                break
            await asyncio.sleep(0.05)
        left = len(router.flights)
        print(f"phantoms dropped after {time.monotonic() - t_drop:.1f}s")
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        await http.close()
        await ctl.stop(0)
        for s in sims:
            await s.stop()
    print(f"warm answers {warm}, stale {stale}, routes in flight at the kill {at_kill}, "
          f"phantom routes left {left}, errors {errors}")
    assert at_kill >= 4  # non-vacuous: killed with tracked routes in flight
    assert errors == [] and stale == 0 and warm > 0
    assert left == 0
