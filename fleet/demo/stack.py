"""Everything the demo (and `kvfleet up`) runs on one machine: local Ray, an embedded store, the
controller, and vLLM stand-in workers registered with it.

    stack = await Stack.start(StackConfig(workers=3, store_url="sqlite:///…/kvfleet.db"))
    stack.admin / stack.client       # AsyncFleetClients: operator, and tenant "demo"
    await stack.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.auth import mint_token
from controller.router import RouterConfig
from controller.server import Controller, ControllerConfig, build_server
from controller.servicers.sessions import kernel_spec_of
from fleet.errors import Unavailable
from fleet.sdk import AsyncFleetClient
from fleet.testkit.sim_vllm.engine import SimEngineConfig
from fleet.testkit.sim_vllm.main import SimConfig, SimVllm

MODEL = "sim-model"


@dataclass(frozen=True, slots=True)
class StackConfig:
    """store_url: sqlite:///PATH or redis://…; ray_address: join a cluster (None: local)."""

    store_url: str
    state_dir: str
    listen: str = "127.0.0.1:0"
    workers: int = 0
    num_blocks: int = 2048
    block_size: int = 16
    tenant: str = "demo"
    ray_address: str | None = None
    ray_num_cpus: int | None = None
    kernel_spec: dict[str, Any] = field(default_factory=lambda: {"block_size": 16})
    controller: dict[str, Any] = field(default_factory=dict)  # more ControllerConfig fields (kvfleet up's flags)


def init_ray(address: str | None, num_cpus: int | None = None) -> bool:
    """Join `address` or start a local Ray (namespace kvfleet); False when one was already up."""
    import ray

    if ray.is_initialized():
        return False
    kw: dict[str, Any] = {"namespace": "kvfleet", "include_dashboard": False, "log_to_driver": False,
                          "configure_logging": False}
    if address:
        ray.init(address=address, **kw)
    else:
        ray.init(num_cpus=num_cpus or max(2, os.cpu_count() or 2), **kw)
    return True


class Stack:
    """A running controller + stand-ins + clients (see module docstring)."""

    def __init__(self, cfg: StackConfig, ctl: Controller, sims: dict[str, SimVllm], operator_token: str,
                 tenant_token: str, owns_ray: bool) -> None:
        self.cfg, self.ctl, self.sims, self.owns_ray = cfg, ctl, sims, owns_ray
        self.operator_token, self.tenant_token = operator_token, tenant_token
        self.admin = AsyncFleetClient(ctl.address, operator_token)
        self.client = AsyncFleetClient(ctl.address, tenant_token)

    @classmethod
    async def start(cls, cfg: StackConfig) -> Stack:
        owns_ray = await asyncio.to_thread(init_ray, cfg.ray_address, cfg.ray_num_cpus)
        tokens = Path(cfg.state_dir) / "tokens.json"
        op = mint_token(tokens, "ops", "operator", "kvfleet-up")
        tenant = mint_token(tokens, cfg.tenant, "tenant", cfg.tenant)
        ccfg = ControllerConfig(listen=cfg.listen, store_url=cfg.store_url, tokens_file=str(tokens), **cfg.controller)
        ctl = await build_server(ccfg, router_config=RouterConfig(probe_on_route=True))
        await asyncio.to_thread(kernel_spec_of, ctl.ctx.store, cfg.kernel_spec)
        sims = {}
        for i in range(cfg.workers):
            eng = SimEngineConfig(model=MODEL, block_size=cfg.block_size, num_blocks=cfg.num_blocks)
            sims[f"w{i}"] = await SimVllm(SimConfig(engine=eng)).start()
        stack = cls(cfg, ctl, sims, op, tenant, owns_ray)
        for name, sim in sims.items():
            await stack.admin.register_worker(name, url=sim.url, kv_events=sim.kv_events, replay=sim.replay or "",
                                              model=MODEL, block_size=cfg.block_size)
        await stack.wait_serving()
        await stack.admin.fleet_sessions()   # builds the session fleet (Ray supervisors) now
        return stack

    async def wait_serving(self, timeout_s: float = 30.0) -> None:
        """Until the controller sees every stand-in serving (its first reconcile)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ws = await self.admin.workers()
            if len(ws) == len(self.sims) and all(w.serving for w in ws):
                return
            await asyncio.sleep(0.1)
        raise Unavailable(f"the stand-in workers did not come up serving within {timeout_s:.0f}s")

    async def stop(self) -> None:
        for c in (self.client, self.admin):
            with contextlib.suppress(Exception):
                await c.close()
        await self.ctl.stop(grace=1.0)
        for sim in self.sims.values():
            with contextlib.suppress(Exception):
                await sim.stop()
        if self.owns_ray:
            import ray

            await asyncio.to_thread(ray.shutdown)
