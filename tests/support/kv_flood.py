"""KV-event streams for the event tests and bench/event_flood.py: a replay ROUTER that answers every request
with many batches (vLLM's wire format), one a test serves itself (`replay_router`), a sink that records what a Subscriber hands it, a live Router whose
worker's events the test publishes (`live_stream`), and another tenant's WhoAmI timed from its own thread."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import zmq
import zmq.asyncio

from controller.config import ControllerConfig
from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from controller.server import build_server
from controller.vllm.subscriber import StreamLimits
from fleet.api.kvfleet.v1 import fleet_pb2, workers_pb2
from fleet.api.kvfleet.v1.fleet_pb2_grpc import FleetServiceStub
from fleet.api.kvfleet.v1.workers_pb2_grpc import WorkerServiceStub
from fleet.app.testkit.sim_vllm import wire
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store
from support.controller import make_tokens, md

END = b"\xff" * 8


@contextlib.asynccontextmanager
async def replay_router(
        serve: Callable[[zmq.asyncio.Socket], Awaitable[None]]) -> AsyncIterator[tuple[zmq.asyncio.Context, str]]:
    """A replay ROUTER on loopback answered by `serve(router)` in a task: yields its context (for the test's other
    sockets, which it closes before leaving) and its address; then stops the task and closes the ROUTER and context."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    url = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    server = asyncio.get_running_loop().create_task(serve(router))
    try:
        yield ctx, url
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server
        router.close(0)
        ctx.term()


class RecordingSink:
    """A Subscriber's sink that records what it was handed: the seqs applied, the invalidations' reasons."""

    def __init__(self) -> None:
        self.seq, self.applied, self.invalid = -1, [], []

    def last_seq(self) -> int:
        return self.seq

    def on_batch(self, seq, batch) -> None:  # type: ignore[no-untyped-def]
        self.seq = seq
        self.applied.append(seq)

    def on_invalidate(self, reason, seq) -> None:  # type: ignore[no-untyped-def]
        self.invalid.append(reason)


class FloodingReplay:
    """A replay ROUTER (own thread, own context) answering each request with `batches` batches (seqs start,
    start + 1, ...) of `events` AllBlocksCleared events, or of `payload`, and then the end marker, as vLLM's
    replay does."""

    def __init__(self, batches: int, events: int = 600, payload: bytes | None = None) -> None:
        self.batches = batches
        self.payload = payload if payload is not None else wire.encode_batch(0.0, [wire.VllmAllBlocksCleared()] * events)
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

    async def __aenter__(self) -> Prober:
        self._thread.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        # NOTE: joined off the event loop: the controller under test serves the last call on it
        self._stop.set()
        await asyncio.to_thread(self._thread.join, 120)


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98] if len(xs) >= 2 else max(xs, default=0.0)


async def run_flood(
    tmp_path: Path, batches: int, *, events: int = 600, window_s: float = 2.0
) -> dict[str, Any]:
    """A real controller (auth on, sqlite store) with an honest sim-vllm worker; another tenant's
    WhoAmI timed every 10 ms while a second worker registers whose replay socket floods `batches`
    batches of `events` AllBlocksCleared events (0: it registers with the honest replay instead, the
    control), and `window_s` more (several tail polls, every 0.5 s). Returns the figures."""
    tok = make_tokens(tmp_path)
    sims = [
        await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=64))).start() for _ in range(2)
    ]
    flood = FloodingReplay(batches=batches, events=events) if batches else None
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
            async with Prober(ctl.address, tok.b) as probe:
                await asyncio.sleep(0.3)
                t0 = time.perf_counter()
                await register("flooder", sims[0], flood.endpoint if flood else sims[0].replay)
                register_s = time.perf_counter() - t0
                await asyncio.sleep(window_s)
            listed = await workers.ListWorkers(workers_pb2.ListWorkersRequest(), metadata=md(tok.op))
            faulty = {
                w: metrics.registry.get_sample_value("kvfleet_worker_faulty", {"worker": w})
                for w in ("flooder", "honest")
            }
    finally:
        await ctl.stop(0)
        if flood is not None:
            flood.close()
        for s in sims:
            await s.stop()
    rows = {(w.spec.name, r.dp_rank): r for w in listed.workers for r in w.ranks}
    lat = probe.latencies
    return {
        "register_s": register_s,
        "latencies": lat,
        "errors": probe.errors,
        "p50": statistics.median(lat),
        "p99": p99(lat),
        "max": max(lat),
        "requests": flood.requests if flood else 0,
        "rows": {k: (r.phase, r.serving) for k, r in rows.items()},
        "faulty": faulty,
        "over_budget": metrics.registry.get_sample_value("kvfleet_kv_events_over_budget_total"),
    }


class LiveStream:
    """A real Router (sqlite store) with one worker "w0" (sim-vllm HTTP, block size 16, `num_blocks` in its pool)
    whose KV events come from a PUB the test writes (`live_stream`); its subscription is up and seq 0 handled; `send(events)` publishes the next seq and waits until it is handled."""

    def __init__(self, r: Any, m: Metrics, pub: zmq.asyncio.Socket, sim: SimVllm | None = None) -> None:
        self.r, self.m, self.pub, self.seq = r, m, pub, 0
        self.sim = sim  # the worker's HTTP (its /metrics: start time, sleep state)

    async def send_payload(self, payload: bytes, seq: int | None = None) -> None:
        seq = self.seq if seq is None else seq
        self.seq = max(self.seq, seq + 1)
        await self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        w = self.r.worker("w0")
        for _ in range(500):
            if w.applied_seq(0) >= seq:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"seq {seq} never handled")

    async def send(self, events: list[Any]) -> None:
        await self.send_payload(wire.encode_batch(0.0, events, 0))

    async def until(self, cond: Any, what: str) -> None:
        for _ in range(500):
            if cond():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(what)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.m.registry.get_sample_value(name, labels or {}) or 0.0

    def blocks(self) -> int:
        return int(self.r.index.num_blocks(("w0", 0)))


@contextlib.asynccontextmanager
async def live_stream(tmp_path: Path, num_blocks: int = 4096, **limits: Any) -> AsyncIterator[LiveStream]:
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=num_blocks))).start()
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    m = Metrics()
    r = Router(store, m, RouterConfig(reconcile_interval_s=0.05, stream=StreamLimits(**limits)))
    await r.start()
    try:
        await r.register_worker(
            WorkerSpec("w0", sim.url, f"tcp://127.0.0.1:{port}", None, "m", block_size=16, hash_algo="sha256")
        )
        hello = wire.encode_batch(0.0, [wire.VllmBlockRemoved(block_hashes=[7], medium="GPU")], 0)
        for _ in range(300):  # until the subscription is up (ZMQ's slow joiner)
            await pub.send_multipart([b"", (0).to_bytes(8, "big"), hello])
            await asyncio.sleep(0.02)
            if r.worker("w0").ranks[0].seq >= 0:
                break
        await asyncio.sleep(0.1)  # a straggling seq 0 (a reset) lands before the test starts
        live = LiveStream(r, m, pub, sim)
        live.seq = 1
        yield live
    finally:
        await r.stop()
        store.close()
        pub.close(0)
        ctx.term()
        await sim.stop()
