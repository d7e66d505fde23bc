"""RegisterWorker refuses a model name a Route could never carry, and an oversized hash_seed, naming field and bound.

Found by scripts/fuzz_grpc.py: the spec's model and hash_seed were unbounded. A worker registered with a model of
1,025 characters was listed and never routed to (Route refuses a model over 1,024 characters: "use the name the workers
were registered with"), and a 1 MiB model was kept in the worker's store record and sent in every ListWorkers and
GetFleet. Real controller and router, a real `kvfleet sim-vllm` stand-in, gRPC on loopback.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from support.controller import make_tokens, md, start_controller, store_url

from fleet.api.kvfleet.v1 import route_pb2, workers_pb2
from fleet.api.kvfleet.v1.route_pb2_grpc import RouteServiceStub
from fleet.api.kvfleet.v1.workers_pb2_grpc import WorkerServiceStub
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm


async def test_a_worker_spec_names_a_model_a_route_can_carry(tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m"))).start()
    ctl = await start_controller(store_url("sqlite", tmp_path), tok, start_router=True)
    try:
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            workers, routes = WorkerServiceStub(ch), RouteServiceStub(ch)

            async def register(model: str, **kw: str) -> workers_pb2.RegisterWorkerResponse:
                spec = workers_pb2.WorkerSpec(name="w0", url=sim.url, kv_events=sim.kv_events, model=model, **kw)
                out: workers_pb2.RegisterWorkerResponse = await workers.RegisterWorker(
                    workers_pb2.RegisterWorkerRequest(spec=spec), metadata=md(tok.op))
                return out

            for model, kw, says in (("m" * 1025, {}, "worker model of 1025 characters"),
                                    ("é" * (1 << 19), {}, "worker model of 524288 characters"),
                                    ("m", {"hash_seed": "7" * 65}, "worker hash_seed of 65 characters")):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await register(model, **kw)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
                assert says in e.value.details() and "over the limit of" in e.value.details(), e.value.details()
            listed = await workers.ListWorkers(workers_pb2.ListWorkersRequest(), metadata=md(tok.op))
            assert list(listed.workers) == []  # nothing was registered
            # the control: at the bounds, the worker is registered and a Route of its model goes to it
            await register("m" * 1024, hash_seed="4294967295")
            got = await routes.Route(route_pb2.RouteRequest(token_ids=list(range(32)), model="m" * 1024),
                                     metadata=md(tok.a))
            assert got.worker == "w0"
            # a Route's lora is bounded as its model is (found by the same fuzz audit: a 1 MiB name was taken)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await routes.Route(route_pb2.RouteRequest(token_ids=[1], model="m" * 1024, lora="l" * 1025),
                                   metadata=md(tok.a))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lora name of 1025 characters" in (
                e.value.details() or ""), e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:  # control: at the bound, an adapter no worker has
                await routes.Route(route_pb2.RouteRequest(token_ids=[1], model="m" * 1024, lora="l" * 1024),
                                   metadata=md(tok.a))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value.details()
    finally:
        await ctl.stop(0)
        await sim.stop()
