"""MoveRoute: a tracked route the proxy sent to another of its candidates (it skipped the chosen worker as
asleep, or failed over from it) moves in the controller's ledgers: in-flight load, the block-pool shadow
and the conversation's working-set record. Before issue #27's fix they all stayed on the worker the
request never reached, so the shadow of the worker that ran it missed its blocks and later routes
trusted blocks that worker had evicted (stale WARM routes after a sleep behind the controller's back).
The real Router and controller on `kvfleet sim-vllm` workers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from controller.auth import mint_token
from controller.config import ControllerConfig
from controller.cost import CostConfig
from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from controller.server import build_server
from fleet.api.kvfleet.v1 import route_pb2
from fleet.api.kvfleet.v1.route_pb2_grpc import RouteServiceStub
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store
from fleet.core.block_hash import external_chain
from fleet.core.errors import FailedPrecondition, InvalidArgument
from fleet.sdk import base

B, NUM_BLOCKS = 16, 64
PROMPT = list(range(1, 161))  # 10 full blocks


async def _sim() -> SimVllm:
    return await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=NUM_BLOCKS))).start()


async def _capacities_known(r: Router, names: list[str]) -> None:
    for _ in range(200):
        if all(r.worker(n).view().load.num_gpu_blocks for n in names):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the workers' capacities were never looked at")


@contextlib.asynccontextmanager
async def _two_workers(tmp_path: Path, cost: CostConfig | None = None) -> AsyncIterator[Router]:
    """A Router with stand-ins w0 and w1 registered and their capacities looked at."""
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    s0, s1 = await _sim(), await _sim()
    r = Router(store, Metrics(), RouterConfig(reconcile_interval_s=0.1, cost=cost or CostConfig()))
    await r.start()
    try:
        await r.register_worker(WorkerSpec("w0", s0.url, s0.kv_events, s0.replay, "m"))
        await r.register_worker(WorkerSpec("w1", s1.url, s1.kv_events, s1.replay, "m"))
        await _capacities_known(r, ["w0", "w1"])
        yield r
    finally:
        await r.stop()
        await s0.stop()
        await s1.stop()


async def test_a_moved_route_takes_its_load_blocks_and_record_to_the_worker_that_ran_it(tmp_path) -> None:
    async with _two_workers(tmp_path) as r:
        d = await r.route(PROMPT, "m", track=True, owner="acme")
        chosen, other = (d.worker, "w1" if d.worker == "w0" else "w0")
        chain = external_chain(r.worker(chosen).view().hash_cfg, PROMPT)
        assert r.flights.load((chosen, 0))[0] == 1 and r.flights.load((other, 0))[0] == 0
        assert all(r.shadow.get((chosen, 0)).cached(h) for h in chain)
        assert r.shadow.get((other, 0)) is None or not any(r.shadow.get((other, 0)).cached(h) for h in chain)
        assert r.demand.previous(chain)[1].key == (chosen, 0)

        assert not r.move_route(d.route_id, other, 0, owner="bravo")  # another tenant's route
        with pytest.raises(FailedPrecondition):
            r.move_route(d.route_id, "w9", 0, owner="acme")  # no such worker: the request must not go there
        with pytest.raises(InvalidArgument):
            r.move_route("not-a-route", other, 0)
        await r.lifecycle(other, "pause", mode="keep", clear_cache=False)
        with pytest.raises(FailedPrecondition, match="not serving now"):
            r.move_route(d.route_id, other, 0, owner="acme")  # paused since the route: refused, not moved
        await r.lifecycle(other, "resume")
        assert r.flights.load((chosen, 0))[0] == 1  # none of those moved anything

        routed_at = r.flights.get(d.route_id).t
        assert r.move_route(d.route_id, other, 0, owner="acme")
        assert r.flights.load((chosen, 0))[0] == 0 and r.flights.load((other, 0))[0] == 1
        assert r.flights.get(d.route_id).t > routed_at  # a verb on its new worker waits for it from the move
        pool = r.shadow.get((other, 0))
        assert pool is not None and all(pool.cached(h) for h in chain)  # its blocks, where it ran
        assert r.demand.previous(chain)[1].key == (other, 0)
        assert r.demand.evidence.rate((0, 0)) == 0  # a move is not a return
        assert r.release_route(d.route_id, owner="acme")  # released where it is now
        assert r.flights.load((other, 0))[0] == 0
        assert not r.move_route(d.route_id, chosen, 0, owner="acme")  # ended: nothing to move
        # candidates are kept only while a route is tracked: released above, and one that the TTL ends
        d2 = await r.route(PROMPT, "m", track=True, owner="acme")
        assert d.route_id not in r._alternatives and d2.route_id in r._alternatives
        r._ended(r.flights.expire(time.monotonic() + r.cfg.cost.inflight_ttl_s + 1), "ttl")
        assert not r._alternatives and not r.move_route(d2.route_id, other, 0, owner="acme")


async def test_move_route_over_grpc_is_the_routing_tenants_own(tmp_path) -> None:
    s0, s1 = await _sim(), await _sim()
    tokens = tmp_path / "tokens.json"
    acme, bravo = mint_token(tokens, "acme", "tenant"), mint_token(tokens, "bravo", "tenant")
    ctl = await build_server(
        ControllerConfig(
            listen="127.0.0.1:0", store_url=f"sqlite:///{tmp_path}/ctl.db", tokens_file=str(tokens)
        ),
        metrics=Metrics(),
    )
    router = ctl.ctx.need_router()
    await router.register_worker(WorkerSpec("w0", s0.url, s0.kv_events, s0.replay, "m"))
    await router.register_worker(WorkerSpec("w1", s1.url, s1.kv_events, s1.replay, "m"))
    channel = grpc.aio.insecure_channel(ctl.address)
    stub = RouteServiceStub(channel)
    try:
        resp = await stub.Route(
            route_pb2.RouteRequest(token_ids=PROMPT, model="m", track=True), metadata=base.metadata(acme)
        )
        other = next(c.worker for c in resp.candidates if c.worker != resp.worker)
        move = route_pb2.MoveRouteRequest(route_id=resp.route_id, worker=other)
        assert not (await stub.MoveRoute(move, metadata=base.metadata(bravo))).moved
        assert (await stub.MoveRoute(move, metadata=base.metadata(acme))).moved
        assert router.flights.load((other, 0))[0] == 1
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.MoveRoute(
                route_pb2.MoveRouteRequest(route_id=resp.route_id), metadata=base.metadata(acme)
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "worker" in (e.value.details() or "")
    finally:
        await channel.close()
        await ctl.stop(0)
        await s0.stop()
        await s1.stop()


async def test_a_tenants_flood_of_tracked_routes_evicts_its_own_candidates_not_anothers(tmp_path, monkeypatch) -> None:
    """Past the cap on kept candidates, the tenant with the most loses its oldest. NOTE: it was oldest first for
    all: mallory's Routes (tracked, never sent) evicted bravo's, whose MoveRoute then moved nothing."""
    import controller.router

    monkeypatch.setattr(controller.router, "MAX_MOVABLE_ROUTES", 8)
    # NOTE: a long grace: the Routes are never sent, and a reconcile look past the grace would end them all
    async with _two_workers(tmp_path, CostConfig(reconcile_grace_s=30.0)) as r:
        d = await r.route(PROMPT, "m", track=True, owner="bravo")
        mallory = [await r.route([1000 + i, *PROMPT[1:]], "m", track=True, owner="mallory") for i in range(20)]
        kept = [m.route_id for m in mallory if m.route_id in r._alternatives]
        assert d.route_id in r._alternatives and len(r._alternatives) == 8
        assert kept == [m.route_id for m in mallory[-7:]]     # mallory's own newest seven
        other = "w1" if d.worker == "w0" else "w0"
        assert r.move_route(d.route_id, other, 0, owner="bravo")
        assert r.flights.load((other, 0))[0] >= 1
