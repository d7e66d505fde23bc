"""The demo's trace replayed live through vLLM's own router (`vllm-router`, when installed).

Fresh stand-in workers (the demo's config), `vllm-router --policy kv_aware` fed by their ZMQ KV
events, and the recorded requests sent through it in the recorded order as `/v1/completions`
with token-id prompts and the tenant's `cache_salt`. Its sleeps and wakes happen at the recorded
points, behind its back (it has no lifecycle API): the worker that received most requests sleeps,
as in the live run. A request that reaches a sleeping worker (seen there, as the routing bench counts
it) hangs, so it is given up at once and sent again (counted); one that answers nothing within the
timeout is given up too. Prefill is read from the workers' own counters.

The `vllm-router` binary comes from the `vllm-router` wheel (`./dev.sh bench fleet_routing`
installs it); without it `replay_vllm_router` returns None and the demo says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
from typing import Any

import aiohttp
from aiohttp import web

from fleet.app.children import dies_with_parent
from fleet.app.demo.model import PolicyResult
from fleet.app.demo.trace import Lifecycle, Request, Trace
from fleet.app.redis_server import free_port
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimVllm
from fleet.app.testkit.sim_vllm.parts import SimConfig

MODEL = "sim-model"
SEND_TIMEOUT_S = 1.0  # shorter than the live demo's 2 s: this router keeps sending to a sleeper
ATTEMPTS = 3
READY_TIMEOUT_S = 20.0


def vllm_router_binary() -> str | None:
    return shutil.which("vllm-router")


def _command(exe: str, port: int, sims: dict[str, SimVllm], block_size: int) -> list[str]:
    cmd = [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", "kv_aware", "--worker-urls",
           *[s.url for s in sims.values()], "--prometheus-port", str(free_port()), "--log-level", "warning"]
    for s in sims.values():
        cmd += ["--kv-event-source", f"{s.url}={s.kv_events}"]
        if s.replay:
            cmd += ["--kv-event-replay-source", f"{s.url}={s.replay}"]
    return cmd + ["--kv-event-block-size", str(block_size), "--kv-event-model", MODEL]


async def _ready(http: aiohttp.ClientSession, base: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = asyncio.get_running_loop().time() + READY_TIMEOUT_S
    while asyncio.get_running_loop().time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm-router exited with {proc.returncode}")
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with http.get(base + "/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
                if r.status == 200:
                    return
        await asyncio.sleep(0.2)
    raise RuntimeError("vllm-router did not become healthy")


class _Asleep:
    """Completion requests that reached a stand-in while it slept, counted at the worker (an aiohttp
    middleware, as `bench/peers/workers.py` counts them)."""

    def __init__(self) -> None:
        self.count = 0
        self.changed = asyncio.Event()

    def middleware(self, sim: SimVllm) -> Any:
        @web.middleware
        async def observe(req: web.Request, handler: Any) -> web.StreamResponse:
            if req.method == "POST" and req.path.startswith("/v1/") and sim.engine.is_sleeping():
                self.count += 1
                self.changed.set()
            return await handler(req)  # type: ignore[no-any-return]

        return observe


async def _post(http: aiohttp.ClientSession, base: str, req: Request) -> bool:
    body = {"model": MODEL, "prompt": list(req.token_ids), "max_tokens": 1, "cache_salt": req.salt}
    try:
        async with http.post(base + "/v1/completions", json=body,
                             timeout=aiohttp.ClientTimeout(total=SEND_TIMEOUT_S)) as r:
            await r.read()
            return r.status == 200
    except (TimeoutError, aiohttp.ClientError):
        return False


async def _send(http: aiohttp.ClientSession, base: str, req: Request, asleep: _Asleep) -> bool:
    """Whether the request was answered. False as soon as it reaches a sleeping worker (it would hang
    there until the wake: NOTE before, each such attempt waited out the 1 s timeout, 215 of them in the
    demo's trace, 3.5 minutes of a 4-minute demo), or after the timeout."""
    seen, post = asleep.count, asyncio.ensure_future(_post(http, base, req))
    while True:
        asleep.changed.clear()
        waiter = asyncio.ensure_future(asleep.changed.wait())
        await asyncio.wait({post, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if post.done():
            return post.result()
        if asleep.count > seen:
            post.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await post
            return False


async def replay_vllm_router(trace: Trace, num_blocks: int, block_size: int) -> PolicyResult | None:
    """The trace through `vllm-router kv_aware` on fresh stand-ins; None when it is not installed."""
    exe = vllm_router_binary()
    if exe is None:
        return None
    cfg = SimEngineConfig(model=MODEL, block_size=block_size, num_blocks=num_blocks)
    sims: dict[str, SimVllm] = {}
    out = PolicyResult.for_workers("vllm_router", trace.workers)
    proc: subprocess.Popen[bytes] | None = None
    asleep = _Asleep()
    try:
        for name in trace.workers:
            sim = SimVllm(SimConfig(engine=cfg))
            sim.middlewares = (asleep.middleware(sim),)
            sims[name] = await sim.start()
        port = free_port()
        # NOTE: it dies with the demo: SIGTERMed mid-replay, the demo left it running (re-parented, listening)
        proc = subprocess.Popen(_command(exe, port, sims, block_size), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, preexec_fn=dies_with_parent())
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:
            await _ready(http, base, proc)
            await _play(trace, sims, http, base, out, asleep)
    finally:
        if proc is not None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            if proc.poll() is None:
                proc.kill()
        await _stop(sims)
    return out


async def _play(trace: Trace, sims: dict[str, SimVllm], http: aiohttp.ClientSession, base: str,
                out: PolicyResult, asleep: _Asleep) -> None:
    slept: dict[str, str] = {}
    for ev in trace.events:
        if isinstance(ev, Lifecycle):
            await _lifecycle(ev, sims, http, slept, out)
            continue
        before = _counts(sims)
        answered = False
        for _ in range(ATTEMPTS):  # a hung request is given up and sent again, as the live demo does
            if answered := await _send(http, base, ev, asleep):
                break
            out.to_sleeping += 1
        after = _counts(sims)
        for n in sims:
            if after[n][0] > before[n][0]:
                out.count(n, ev.num_tokens)
        tally(out, ev.num_tokens, answered)
    # prefilled = what the workers computed (a hung request that ran after the wake counts too)
    out.reused_tokens = reused_of(out.total_tokens, sum(s.engine.queries - s.engine.hits for s in sims.values()))


def tally(out: PolicyResult, num_tokens: int, answered: bool) -> None:
    """One replayed request counted: its prompt tokens join the total only when it was answered.
    NOTE: before, an unanswered request's tokens joined the total, and, never prefilled, came out as reused
    (the hit rate of a routing that left 12 of 42 requests unanswered beat every other)."""
    out.num_requests += 1
    if answered:
        out.total_tokens += num_tokens
    else:
        out.failed += 1


def reused_of(answered_tokens: int, prefilled: int) -> int:
    """Reused tokens of the answered requests: their tokens less all the workers computed (which may hold a
    given-up request run after a wake: counted against the routing, never for it)."""
    return max(0, answered_tokens - prefilled)


def _counts(sims: dict[str, SimVllm]) -> dict[str, tuple[int, int]]:
    """(prompt tokens seen, of which hits) per worker: the engines' own counters."""
    return {n: (s.engine.queries, s.engine.hits) for n, s in sims.items()}


async def _lifecycle(ev: Lifecycle, sims: dict[str, SimVllm], http: aiohttp.ClientSession,
                     slept: dict[str, str], out: PolicyResult) -> None:
    if ev.action == "sleep":
        awake = [n for n in sims if not sims[n].engine.is_sleeping()]
        slept[ev.via] = max(awake, key=lambda n: (out.per_worker.get(n, 0), n))
        path = "/sleep?level=1"
    else:
        path = "/wake_up"
    async with http.post(sims[slept[ev.via]].url + path) as r:
        r.raise_for_status()


async def _stop(sims: dict[str, SimVllm]) -> None:
    async with aiohttp.ClientSession() as http:
        for s in sims.values():
            if s.engine.is_sleeping():
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.post(s.url + "/wake_up"):
                        pass
    for s in sims.values():
        await s.stop()


def summary_row(res: PolicyResult | None) -> dict[str, Any] | None:
    return None if res is None else res.to_dict()
