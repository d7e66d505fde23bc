"""A real fleet on loopback for the proxy tests: a controller (router on, auth on), sim-vllm workers
registered through the SDK, and a proxy in front. Each sim's HTTP app gets an observing middleware
(it records, per request, the path, how the handler ended and its connection) so a test can see
exactly which requests a worker received and whether it saw the client go away. Nothing is mocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from controller.cost import CostConfig
from controller.proxy import Proxy
from controller.proxy.control import ControlClient
from controller.router import RouterConfig
from controller.server import Controller
from fleet.app.testkit.sim_vllm.main import SimVllm
from fleet.app.testkit.stack import StackConfig, start_stack
from fleet.sdk import AsyncFleetClient

BLOCK = 16
MODEL = "sim-model"


@dataclasses.dataclass(slots=True)
class Seen:
    """One request a sim received."""

    method: str
    path: str
    proto: Any
    headers: CIMultiDict[str]
    outcome: str = "running"  # "ok" | "running" | the exception's class name

    @property
    def disconnected(self) -> bool:
        return self.proto.transport is None


def observe(sim: SimVllm) -> list[Any]:
    """The stand-in's observing middleware: it records each request in `sim.seen`."""
    sim.seen = []  # type: ignore[attr-defined]

    @web.middleware
    async def middleware(req: web.Request, handler: Any) -> web.StreamResponse:
        s = Seen(req.method, req.path, req.protocol, CIMultiDict(req.headers))
        sim.seen.append(s)  # type: ignore[attr-defined]
        try:
            resp = await handler(req)
            s.outcome = "ok"
            return resp  # type: ignore[no-any-return]
        except BaseException as e:
            s.outcome = type(e).__name__
            raise

    return [middleware]


def served(sim: SimVllm, path: str | None = None) -> list[Seen]:
    """Requests the sim received from the proxy's paths (the controller's reconcile polls are left out)."""
    paths = {"/v1/completions", "/v1/chat/completions", "/tokenize"} if path is None else {path}
    return [s for s in sim.seen if s.path in paths]  # type: ignore[attr-defined]


@dataclasses.dataclass(slots=True)
class Fleet:
    ctl: Controller
    sims: dict[str, SimVllm]
    tokens: dict[str, str]  # "a", "b" (tenants acme, bravo), "op" (operator)
    proxy: Proxy
    http: aiohttp.ClientSession
    op: AsyncFleetClient

    def headers(self, who: str = "a") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[who]}"}

    async def post(
        self, path: str, body: dict[str, Any], who: str = "a"
    ) -> tuple[int, dict[str, str], bytes]:
        async with self.http.post(self.proxy.url + path, json=body, headers=self.headers(who)) as r:
            return r.status, dict(r.headers), await r.read()

    async def blocks_known(self, worker: str) -> int:
        """How many of the worker's blocks the controller's index holds (KV events arrive asynchronously)."""
        return sum(r.num_blocks for w in await self.op.workers() if w.name == worker for r in w.ranks)

    async def stop(self) -> None:
        for (
            s
        ) in self.sims.values():  # wake sleepers so their queued requests end (a sim's stop waits for them)
            async with self.http.post(s.url + "/wake_up") as r:
                assert r.status == 200
        await self.http.close()
        await self.proxy.stop()
        await self.op.close()
        await self.ctl.stop(0)
        for s in self.sims.values():
            await s.stop()


# the stand-ins' context length for a test that needs an answer far longer than the default 8192 allows (a stream that
# must still be running when the client leaves)
LONG_CONTEXT: dict[str, Any] = {"max_model_len": 1 << 20}


async def start_fleet(
    tmp_path: Path,
    num_workers: int = 3,
    reconcile_s: float = 0.5,
    loras: dict[str, str] | None = None,
    cost: CostConfig | None = None,
    engine_kw: dict[str, Any] | None = None,
    worker_middleware: Callable[[SimVllm], Any] | None = None,
    router_kw: dict[str, Any] | None = None,
    **proxy_kw: Any,
) -> Fleet:
    """Controller + sims + proxy on loopback (fleet.app.testkit.stack); reconcile_s is the controller's reconcile interval (how long a
    sleep behind its back goes unseen), cost its placement weights, engine_kw override the sims'
    SimEngineConfig fields (e.g. time_scale=1 for a clocked, busy worker); worker_middleware(sim), an aiohttp middleware
    each stand-in runs inside the observing one (a worker that misbehaves on cue); router_kw, more RouterConfig
    fields; proxy_kw override ProxyConfig fields."""
    kw: dict[str, Any] = {"first_byte_timeout_s": 0.3, "refresh_s": 0.2, "suspect_s": 3.0}
    kw.update(proxy_kw)
    stack = await start_stack(StackConfig(
        store_url=f"sqlite:///{tmp_path / 'kv.db'}", state_dir=str(tmp_path), workers=num_workers, num_blocks=512,
        block_size=BLOCK, model=MODEL, engine={"loras": dict(loras or {}), **(engine_kw or {})},
        tenants=("acme", "bravo"), operator="ops", operator_name="", sessions=False, metrics=True, proxy=kw,
        router=RouterConfig(reconcile_interval_s=reconcile_s, cost=cost or CostConfig(), **(router_kw or {}))),
        observe=observe if worker_middleware is None else (lambda sim: [*observe(sim), worker_middleware(sim)]))
    assert stack.proxy is not None
    await stack.client.close()
    tokens = {"a": stack.tokens["acme"], "b": stack.tokens["bravo"], "op": stack.tokens["ops"]}
    return Fleet(stack.ctl, stack.sims, tokens, stack.proxy, aiohttp.ClientSession(), stack.admin)



@contextlib.asynccontextmanager
async def linked_fleet(tmp_path: Path, **kw: Any) -> AsyncIterator[tuple[Fleet, ControlClient]]:
    """start_fleet(tmp_path, **kw) and a ControlClient of the test's own to its controller (the proxy's kept apart)."""
    fleet = await start_fleet(tmp_path, **kw)
    control = ControlClient(fleet.proxy.control.target)
    try:
        yield fleet, control
    finally:
        await control.close()
        await fleet.stop()

def count_whoami(control: ControlClient) -> list[int]:
    """Count the proxy's WhoAmI calls to the controller from now on: [calls], read as it grows."""
    calls = [0]
    real = control._fleet.WhoAmI

    def counted(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        return real(*a, **k)

    control._fleet.WhoAmI = counted
    return calls


async def until(fn: Callable[[], Awaitable[Any]], pred: Callable[[Any], bool], timeout: float = 10.0) -> Any:
    """Poll an async call until pred(result) holds; fail loudly on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        r = await fn()
        if pred(r):
            return r
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s; last value: {r!r}")
        await asyncio.sleep(0.05)


async def proxy_released(fleet: Any, n: int) -> None:
    """Wait until the proxy has counted `n` routes released. The proxy counts a release when the controller
    answers its ReleaseRoute, after the router has dropped the route: a test that saw the router's flights fall
    to 0 can still find the proxy's counter one short (it did, on a loaded machine)."""
    released = fleet.proxy.metrics.releases.labels("released")

    async def value() -> float:
        return float(released._value.get())

    await until(value, lambda k: k == n)


def sse_events(raw: bytes) -> list[str]:
    """The `data:` payloads of an SSE body, in order."""
    return [line[len("data: ") :] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
