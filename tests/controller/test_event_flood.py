"""A worker whose replay socket floods the controller with events never freezes it (issue #31 item 1).

The peer is a real ZMQ ROUTER, in its own thread, that answers every replay request with many
batches of 600 `AllBlocksCleared` events each (vLLM's wire format), well inside the batch and byte
caps of one replay. Another tenant calls WhoAmI every 10 ms from its own thread meanwhile. Before
the fix, the controller applied a whole replay on its event loop without yielding (and again on
every tail poll): WhoAmI waited for it. Now events are applied in slices that yield, each rank has
an event budget, and the worker that overruns it is marked faulty: not routed to, listed as
phase "faulty", counted in the metrics. The full-scale flood of the issue (19,000 batches) is
bench/event_flood.py.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from pathlib import Path

import grpc
import zmq
from support.controller import make_tokens, md

from controller.metrics import Metrics
from controller.router import RouterConfig
from controller.server import ControllerConfig, build_server
from fleet.api.kvfleet.v1 import fleet_pb2, workers_pb2
from fleet.api.kvfleet.v1.fleet_pb2_grpc import FleetServiceStub
from fleet.api.kvfleet.v1.workers_pb2_grpc import WorkerServiceStub
from fleet.testkit.sim_vllm import wire
from fleet.testkit.sim_vllm.engine import SimEngineConfig
from fleet.testkit.sim_vllm.main import SimConfig, SimVllm

END = b"\xff" * 8


class FloodingReplay:
    """A replay ROUTER (own thread, own context) answering each request with `batches` batches of
    `events` AllBlocksCleared events and then the end marker, as vLLM's replay does."""

    def __init__(self, batches: int, events: int = 600) -> None:
        self.batches = batches
        self.payload = wire.encode_batch(0.0, [wire.VllmAllBlocksCleared()] * events)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.requests = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            ident, _, start = self.sock.recv_multipart()
            self.requests += 1
            seq = int.from_bytes(start, "big")
            for i in range(self.batches):
                self.sock.send_multipart([ident, b"", b"", (seq + i).to_bytes(8, "big"), self.payload])
            self.sock.send_multipart([ident, b"", b"", END, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
        self.ctx.term()


class Prober:
    """Another tenant's WhoAmI every 10 ms from its own thread (a blocking gRPC channel)."""

    def __init__(self, address: str, token: str) -> None:
        self.address, self.token = address, token
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with grpc.insecure_channel(self.address) as ch:
            stub = FleetServiceStub(ch)
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    stub.WhoAmI(fleet_pb2.WhoAmIRequest(), metadata=md(self.token), timeout=60)
                except grpc.RpcError as e:
                    self.errors.append(str(e.code()))
                self.latencies.append(time.perf_counter() - t0)
                time.sleep(0.01)

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98] if len(xs) >= 2 else max(xs, default=0.0)


async def test_a_flooding_replay_endpoint_does_not_freeze_the_controller(tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    sims = [
        await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=64))).start() for _ in range(2)
    ]
    flood = FloodingReplay(batches=1500)  # 900,000 events per replay
    metrics = Metrics()
    cfg = ControllerConfig(
        store_url=f"sqlite:///{tmp_path / 'kv.db'}", tokens_file=tok.file, listen="127.0.0.1:0"
    )
    ctl = await build_server(cfg, metrics=metrics, router_config=RouterConfig(reconcile_interval_s=0.5))
    try:
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            workers = WorkerServiceStub(ch)

            async def register(name: str, sim: SimVllm, replay: str) -> None:
                spec = workers_pb2.WorkerSpec(
                    name=name, url=sim.url, kv_events=sim.kv_events, replay=replay, model="m"
                )
                await workers.RegisterWorker(
                    workers_pb2.RegisterWorkerRequest(spec=spec), metadata=md(tok.op), timeout=120
                )

            await register("honest", sims[1], sims[1].replay)
            with Prober(ctl.address, tok.b) as probe:
                await asyncio.sleep(0.3)
                t0 = time.perf_counter()
                await register("flooder", sims[0], flood.endpoint)
                register_s = time.perf_counter() - t0
                await asyncio.sleep(2.0)  # several tail polls (every 0.5 s) of the flooding endpoint
            listed = await workers.ListWorkers(workers_pb2.ListWorkersRequest(), metadata=md(tok.op))
            faulty = {
                w: metrics.registry.get_sample_value("kvfleet_worker_faulty", {"worker": w})
                for w in ("flooder", "honest")
            }
    finally:
        await ctl.stop(0)
        flood.close()
        for s in sims:
            await s.stop()
    rows = {(w.spec.name, r.dp_rank): r for w in listed.workers for r in w.ranks}
    lat = probe.latencies
    print(
        f"register {register_s:.2f}s; WhoAmI n={len(lat)} p50={statistics.median(lat) * 1e3:.1f}ms "
        f"p99={p99(lat) * 1e3:.1f}ms max={max(lat) * 1e3:.0f}ms; replay requests {flood.requests}; "
        f"rows {[(k, r.phase, r.serving) for k, r in rows.items()]}"
    )
    assert not probe.errors and len(lat) > 50
    assert p99(lat) < 0.1, f"another tenant's WhoAmI p99 {p99(lat) * 1e3:.0f} ms during the flood"
    assert rows[("flooder", 0)].phase == "faulty" and not rows[("flooder", 0)].serving
    assert rows[("honest", 0)].phase != "faulty" and rows[("honest", 0)].serving  # control: not every worker
    assert faulty["flooder"] == 1 and faulty["honest"] in (None, 0)
