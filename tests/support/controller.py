"""Helpers for the controller gRPC tests: tokens files and a real controller on a loopback port 0."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import grpc

from controller.auth import mint_token
from controller.config import ControllerConfig
from controller.metrics import Metrics
from controller.server import Controller, build_server


@dataclasses.dataclass(frozen=True, slots=True)
class Tokens:
    file: str
    a: str  # tenant "acme"
    b: str  # tenant "bravo"
    op: str  # operator, tenant "ops"


def make_tokens(tmp_path: Path) -> Tokens:
    f = tmp_path / "tokens.json"
    return Tokens(str(f), mint_token(f, "acme", "tenant"), mint_token(f, "bravo", "tenant"),
                  mint_token(f, "ops", "operator", name="ops-admin"))


def store_url(kind: str, tmp_path: Path, redis_url: str | None = None) -> str:
    return redis_url if kind == "redis" else f"sqlite:///{tmp_path / 'kvfleet.db'}"


async def start_controller(url: str, tokens: Tokens | None, **kw: Any) -> Controller:
    """A real controller on 127.0.0.1:0; kw override ControllerConfig fields (start_router=False by default)."""
    kw.setdefault("start_router", False)
    kw.setdefault("listen", "127.0.0.1:0")
    cfg = ControllerConfig(store_url=url, tokens_file=tokens.file if tokens else None, **kw)
    return await build_server(cfg, metrics=Metrics())


def md(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


async def code_of(aw: Any) -> grpc.StatusCode:
    try:
        await aw
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def lanes_idle(ctl: object, tenant: str, timeout_s: float = 300.0) -> None:
    """Wait until `tenant`'s judge lane has nothing queued or running (its background jobs are done)."""
    lanes = ctl.ctx.judge_lanes  # type: ignore[attr-defined]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (st := lanes.stats(tenant))["queued"] or st["inflight"]:
        assert asyncio.get_running_loop().time() < deadline, f"{tenant}'s judge lane still busy: {st}"
        await asyncio.sleep(0.05)
