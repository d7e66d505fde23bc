"""A worker whose replay socket floods the controller with events never freezes it (issue #31 item 1).

The peer is a real ZMQ ROUTER, in its own thread, that answers every replay request with many
batches of 600 `AllBlocksCleared` events each (vLLM's wire format), well inside the batch and byte
caps of one replay. Another tenant calls WhoAmI every 10 ms from its own thread meanwhile. Before
the fix, the controller applied a whole replay on its event loop without yielding (and again on
every tail poll): WhoAmI waited for it. Now events are applied in slices that yield, each rank has
an event budget, and the worker that overruns it is marked faulty: not routed to, listed as
phase "faulty", counted in the metrics. The full-scale flood of the issue (19,000 batches) is
bench/event_flood.py, with these helpers (tests/support/kv_flood.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from support.kv_flood import run_flood


async def test_a_flooding_replay_endpoint_does_not_freeze_the_controller(tmp_path: Path) -> None:
    r = await run_flood(tmp_path, batches=1500)  # 900,000 events per replay
    print(
        f"register {r['register_s']:.2f}s; WhoAmI n={len(r['latencies'])} p50={r['p50'] * 1e3:.1f}ms "
        f"p99={r['p99'] * 1e3:.1f}ms max={r['max'] * 1e3:.0f}ms; replay requests {r['requests']}; rows {r['rows']}"
    )
    assert not r["errors"] and len(r["latencies"]) > 50
    assert r["p99"] < 0.1, f"another tenant's WhoAmI p99 {r['p99'] * 1e3:.0f} ms during the flood"
    assert r["rows"][("flooder", 0)] == ("faulty", False)
    assert (
        r["rows"][("honest", 0)][1] and r["rows"][("honest", 0)][0] != "faulty"
    )  # control: not every worker
    assert r["faulty"]["flooder"] == 1 and r["faulty"]["honest"] in (None, 0)


async def test_a_live_message_of_too_many_events_is_refused_before_it_is_decoded(tmp_path: Path) -> None:
    """One live message is decoded in one uninterruptible call: a message announcing more events
    than one may carry (4,096) is refused undecoded and its worker is faulty; a control of 4,000
    events is applied (in slices). NOTE: a 200,000-event message used to be decoded and applied in
    one go (about a second of the event loop here; the longest loop gaps are printed, bench-free)."""
    import asyncio
    import time

    import zmq
    import zmq.asyncio

    from controller.metrics import Metrics
    from controller.router import Router, RouterConfig, WorkerSpec
    from fleet.app.testkit.sim_vllm import wire
    from fleet.app.testkit.sim_vllm.engine import SimEngineConfig
    from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
    from fleet.cas import open_store

    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=64))).start()
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    m = Metrics()
    r = Router(store, m, RouterConfig(reconcile_interval_s=0.05))
    await r.start()

    def removed(n: int, seq: int) -> list[bytes]:
        ev = wire.VllmBlockRemoved(block_hashes=[7], medium="GPU")
        return [b"", seq.to_bytes(8, "big"), wire.encode_batch(0.0, [ev] * n)]

    def applied() -> float:
        return m.registry.get_sample_value("kvfleet_kv_events_total", {"type": "BlockRemoved"}) or 0.0

    async def until(cond: Any, what: str) -> float:
        t0 = time.perf_counter()
        for _ in range(500):
            if cond():
                return time.perf_counter() - t0
            await asyncio.sleep(0.01)
        raise AssertionError(what)

    try:
        await r.register_worker(
            WorkerSpec("w0", sim.url, f"tcp://127.0.0.1:{port}", None, "m", block_size=16, hash_algo="sha256")
        )
        first = removed(1, 0)
        for _ in range(300):  # until the subscription is up (ZMQ's slow joiner)
            await pub.send_multipart(first)
            await asyncio.sleep(0.02)
            if r.worker("w0").ranks[0].seq >= 0:
                break
        # 100,000 events: 4.4 MB, under the 8 MiB ZMQ_MAXMSGSIZE (a larger message never reaches the controller)
        small, big = removed(4_000, 1), removed(100_000, 2)
        await pub.send_multipart(small)
        control_s = await until(lambda: applied() >= 4_001, "the 4,000-event control applied")
        await pub.send_multipart(big)
        w = r.worker("w0")
        big_s = await until(
            lambda: applied() > 4_001 or getattr(w, "faulty", bool)(), "the big message handled"
        )
        rows = [(row.phase, row.serving) for row in r.workers()]
        refused = m.registry.get_sample_value("kvfleet_kv_events_over_budget_total")
    finally:
        await r.stop()
        store.close()
        pub.close(0)
        ctx.term()
        await sim.stop()
    print(
        f"4,000 events applied in {control_s * 1e3:.0f} ms; the 100,000-event message refused in {big_s * 1e3:.0f} ms"
    )
    assert applied() == 4_001  # the control, and nothing of the big message (never decoded)
    assert refused == 100_000 and rows == [("faulty", False)]
