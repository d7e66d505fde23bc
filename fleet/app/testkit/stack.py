"""One way to stand a fleet up on one machine: a controller, vLLM stand-ins registered with it, bearer
tokens, and (optionally) the session fleet on Ray and a proxy in front. The demo and `kvfleet up`, the
tests and the benches all build their fleets here, so "controller + N stand-ins + tokens + register"
is written once.

    stack = await start_stack(StackConfig(store_url="sqlite:///…/kvfleet.db", state_dir=…, workers=3))
    stack.admin / stack.client        # AsyncFleetClients: the operator, and the first tenant
    stack.tokens["acme"]              # every tenant's token (and the operator's under its name)
    stack.sims["w0"].url              # the stand-ins, w0..w{n-1}
    stack.proxy.url                   # when StackConfig.proxy was given
    await stack.stop()

The pieces are usable alone: `mint_tokens`, `start_sims`, `register_sims`, `wait_serving`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.auth import mint_token
from controller.config import ControllerConfig
from controller.kernel_placement import kernel_spec_of
from controller.metrics import Metrics
from controller.proxy import Proxy, ProxyConfig
from controller.ray_address import check_reachable
from controller.router import RouterConfig
from controller.server import Controller, build_server
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimVllm
from fleet.app.testkit.sim_vllm.parts import SimConfig
from fleet.core.errors import Unavailable
from fleet.sdk import AsyncFleetClient

MODEL = "sim-model"


@dataclass(frozen=True, slots=True)
class StackConfig:
    """store_url: sqlite:///PATH or redis://…; state_dir: where the tokens file goes.

    workers: how many stand-ins (w0..); engine: more SimEngineConfig fields for them (model, block_size and
    num_blocks come from here). tenants: the tenants to mint tokens for (the first one is `client`'s);
    operator: the operator's tenant, operator_name its token's name. router: the controller's RouterConfig (None: probe on route, the
    demo's choice). controller: more ControllerConfig fields. sessions: build the session fleet on Ray
    (join `ray_address`, or start a local Ray). proxy: ProxyConfig fields for a proxy in front (None: no
    proxy). metrics: a fresh Prometheus registry per controller (tests run many in one process).
    """

    store_url: str
    state_dir: str
    listen: str = "127.0.0.1:0"
    workers: int = 0
    num_blocks: int = 2048
    block_size: int = 16
    model: str = MODEL
    engine: Mapping[str, Any] = field(default_factory=dict)
    tenants: tuple[str, ...] = ("demo",)
    operator: str = "ops"
    operator_name: str = "kvfleet-up"
    router: RouterConfig | None = None
    controller: Mapping[str, Any] = field(default_factory=dict)
    sessions: bool = True
    ray_address: str | None = None
    ray_num_cpus: int | None = None
    own_ray_tree: bool = False  # a local Ray started here dies with this process, its agents too (`kvfleet up`, `kvfleet demo`)
    kernel_spec: Mapping[str, Any] = field(default_factory=lambda: {"block_size": 16})
    proxy: Mapping[str, Any] | None = None
    metrics: bool = False

    @property
    def tenant(self) -> str:
        return self.tenants[0]


def mint_tokens(path: Path, tenants: Sequence[str], operator: str = "ops", operator_name: str = "") -> dict[str, str]:
    """A tokens file at `path` with one tenant token per name and one operator token (key: `operator`)."""
    out = {operator: mint_token(path, operator, "operator", operator_name)}
    out.update({t: mint_token(path, t, "tenant", t) for t in tenants})
    return out


Observe = Callable[[SimVllm], Sequence[Any]]  # a stand-in -> aiohttp middlewares put first in its HTTP app


async def start_sims(n: int, engine: SimEngineConfig, *, observe: Observe | None = None,
                     prefix: str = "w") -> dict[str, SimVllm]:
    """n stand-ins named {prefix}0.. on loopback, all from one engine config; `observe` gives each its
    middlewares (tests and benches record what a worker received with them)."""
    sims: dict[str, SimVllm] = {}
    try:
        for i in range(n):
            # each its own (mutable) config; NOTE: and its own adapters (a runtime load changes one worker's only)
            sim = SimVllm(SimConfig(engine=dataclasses.replace(engine, loras=dict(engine.loras))))
            sim.middlewares = tuple(observe(sim)) if observe else ()
            sims[f"{prefix}{i}"] = await sim.start()
    except BaseException:
        for s in sims.values():
            await s.stop()
        raise
    return sims


async def register_sims(op: AsyncFleetClient, sims: Mapping[str, SimVllm], model: str,
                        block_size: int | None = None) -> None:
    """Register each stand-in with the controller under its name (operator client)."""
    for name, s in sims.items():
        await op.register_worker(name, url=s.url, kv_events=s.kv_events, replay=s.replay or "", model=model,
                                 block_size=block_size)


SIMS_FILE = "sim-workers.json"  # in the state dir: the stand-ins a stack registered, unregistered by its next start


async def replace_earlier_sims(op: AsyncFleetClient, state_dir: str, names: Sequence[str]) -> None:
    """Unregister the stand-ins an earlier stack on this state dir registered (their ports died with it), and any
    worker registered under a name the new ones take, then record the new names. NOTE: a second `kvfleet up
    --sim-workers 2` on the same state dir (its default, ./var) stopped at "worker 'w0' is registered with another
    spec" (review finding)."""
    f = Path(state_dir) / SIMS_FILE
    earlier = json.loads(f.read_text()) if f.exists() else []
    registered = {w.name for w in await op.workers()}
    for name in sorted(registered & {*earlier, *names}):
        await op.unregister_worker(name)
    f.write_text(json.dumps(list(names)))


async def wait_serving(op: AsyncFleetClient, n: int, timeout_s: float = 30.0,
                       names: Sequence[str] | None = None) -> None:
    """Until the controller sees n workers, all serving (its first reconcile); with `names`, those n."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ws = await op.workers()
        if names is not None:
            ws = [w for w in ws if w.name in names]
        if len(ws) == n and all(w.serving for w in ws):
            return
        await asyncio.sleep(0.05)
    raise Unavailable(f"the stand-in workers did not come up serving within {timeout_s:.0f}s")


async def settled_workers(op: AsyncFleetClient, sims: Mapping[str, SimVllm], timeout_s: float = 3.0) -> list[Any]:
    """The controller's worker rows once each says serving exactly where its stand-in is awake (a sleep or
    wake behind the controller's back shows at its next look), or as they are after `timeout_s`.
    NOTE: the demo listed them at once, so a worker woken behind its back in the last turn showed asleep."""
    deadline = time.monotonic() + timeout_s
    while True:
        ws = await op.workers()
        truth = {n: not s.engine.is_sleeping() for n, s in sims.items()}
        if all(w.serving == truth.get(w.name, w.serving) for w in ws) or time.monotonic() >= deadline:
            return list(ws)
        await asyncio.sleep(0.05)


def init_ray(address: str | None, num_cpus: int | None = None, own_tree: bool = False) -> bool:
    """Join `address` or start a local Ray (namespace kvfleet); False when one was already up. An `address` where
    nothing answers raises InvalidArgument naming --ray-address (controller/ray_address.py), Ray or no Ray."""
    import ray

    if address:
        check_reachable(address)
    if ray.is_initialized():
        return False
    kw: dict[str, Any] = {"namespace": "kvfleet", "include_dashboard": False, "log_to_driver": False,
                          "configure_logging": False}
    if address:
        ray.init(address=address, **kw)
        return True

    def local() -> None:
        ray.init(num_cpus=num_cpus or max(2, os.cpu_count() or 2), **kw)

    if own_tree:  # `kvfleet up`: the local Ray's whole process tree goes with this process (controller/ray_local.py)
        from controller import ray_local

        ray_local.own()
        ray_local.start(local)
    else:
        local()
    return True


class Stack:
    """A running controller + stand-ins + clients (+ proxy); see the module docstring."""

    def __init__(self, cfg: StackConfig, ctl: Controller, sims: dict[str, SimVllm], tokens: dict[str, str],
                 owns_ray: bool) -> None:
        self.cfg, self.ctl, self.sims, self.tokens, self.owns_ray = cfg, ctl, sims, tokens, owns_ray
        self.operator_token, self.tenant_token = tokens[cfg.operator], tokens[cfg.tenant]
        self.admin = AsyncFleetClient(ctl.address, self.operator_token)
        self.client = AsyncFleetClient(ctl.address, self.tenant_token)
        self.proxy: Proxy | None = None

    async def stop(self) -> None:
        if self.proxy is not None:
            with contextlib.suppress(Exception):
                await self.proxy.stop()
        for c in (self.client, self.admin):
            with contextlib.suppress(Exception):
                await c.close()
        await self.ctl.stop(grace=1.0)
        for sim in self.sims.values():
            with contextlib.suppress(Exception):
                await sim.stop()
        if self.owns_ray:
            await asyncio.to_thread(stop_ray, self.cfg.own_ray_tree)


def stop_ray(own_tree: bool) -> None:
    """Disconnect from the Ray that init_ray joined or started (owned: with its whole process tree)."""
    import ray

    from controller import ray_local

    if own_tree:
        ray_local.stop()
    else:
        ray.shutdown()


async def _start_ray(cfg: StackConfig) -> bool:
    """init_ray in a thread. NOTE: ray.init cannot be interrupted: cancelled meanwhile (the demo's SIGTERM),
    this waits for it and stops what it started before it lets the cancellation through; before, the process
    went on to exit with Ray's agents left to the watchdog, a few seconds after it."""
    start = asyncio.ensure_future(asyncio.to_thread(init_ray, cfg.ray_address, cfg.ray_num_cpus, cfg.own_ray_tree))
    try:
        return await asyncio.shield(start)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            if await start:
                await asyncio.to_thread(stop_ray, cfg.own_ray_tree)
        raise


async def start_stack(cfg: StackConfig, *, observe: Observe | None = None) -> Stack:
    """observe: each stand-in's own aiohttp middlewares (to record what it receives)."""
    owns_ray = await _start_ray(cfg) if cfg.sessions else False
    tokens_file = Path(cfg.state_dir) / "tokens.json"
    tokens = mint_tokens(tokens_file, cfg.tenants, cfg.operator, cfg.operator_name)
    ccfg = ControllerConfig(listen=cfg.listen, store_url=cfg.store_url, tokens_file=str(tokens_file), **cfg.controller)
    ctl = await build_server(ccfg, router_config=cfg.router or RouterConfig(probe_on_route=True),
                             **({"metrics": Metrics()} if cfg.metrics else {}))
    await asyncio.to_thread(kernel_spec_of, ctl.ctx.store, dict(cfg.kernel_spec))
    eng = SimEngineConfig(**{"model": cfg.model, "block_size": cfg.block_size, "num_blocks": cfg.num_blocks,
                             **cfg.engine})
    stack = Stack(cfg, ctl, {}, tokens, owns_ray)
    try:
        stack.sims.update(await start_sims(cfg.workers, eng, observe=observe))
        await replace_earlier_sims(stack.admin, cfg.state_dir, list(stack.sims))
        await register_sims(stack.admin, stack.sims, cfg.model, cfg.block_size)
        await wait_serving(stack.admin, len(stack.sims), names=list(stack.sims))
        if cfg.sessions:
            await stack.admin.fleet_sessions()  # builds the session fleet (its Ray kernel hosts) now
        if cfg.proxy is not None:
            pcfg = ProxyConfig(**{"controller": ctl.address, "listen": "127.0.0.1:0",
                                  "token": stack.operator_token, **cfg.proxy})
            stack.proxy = await Proxy(pcfg).start()
    except BaseException:
        await stack.stop()
        raise
    return stack
