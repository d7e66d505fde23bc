"""Router: fail-closed verdicts, controller-owned verbs, bad input, junk workers, restart from the store."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
from aiohttp import web
from support.stand_ins import routed_stand_ins
from support.vllm_vectors import frames, load
from support.waits import wait_until

from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store
from fleet.core.errors import InvalidArgument, NotFound, Unavailable

TOKS = list(range(1000, 1100))  # 6 full blocks


@pytest.fixture(params=["sqlite", "redis"])
def store(request, tmp_path):
    url = f"sqlite:///{tmp_path}/kv.db" if request.param == "sqlite" else request.getfixturevalue("redis_url")
    s = open_store(url)
    yield s
    s.close()


async def _sims(n, **kw):
    return [await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=64, **kw))).start() for _ in range(n)]


async def _router(store, **kw) -> Router:
    r = Router(store, Metrics(), RouterConfig(**{"reconcile_interval_s": 0.1, **kw}))
    await r.start()
    return r


async def _complete(sim, toks, router=None, **kw):
    async with aiohttp.ClientSession() as h, h.post(sim.url + "/v1/completions", json={"prompt": toks, **kw}) as r:
        assert r.status == 200
    if router is None:  # a caller that drops the worker's batches on purpose: nothing to wait for
        await asyncio.sleep(0.05)
        return

    def ingested() -> bool:
        return all(s.last_seq >= sim.publisher.seq - 1 for s in router.workers() if s.url == sim.url)

    for step in range(700):  # until the router has ingested every batch the worker published
        await asyncio.sleep(0.01)
        if ingested():
            return
        if step == 200:
            # NOTE: a batch published before the SUB socket finished connecting is lost (ZMQ's slow joiner) and
            # nothing follows it to show the gap; the controller's tail poll replays it every reconcile interval,
            # which some tests set to 30 s. Under load this left the route COLD (2 failures in 10 runs on a busy
            # machine); poll now, as the controller would
            for w in router._workers.values():
                for sub in w._subs:
                    await sub.poll_tail()
    raise AssertionError("the router did not ingest the worker's KV events within 7 s")


def _spec(i, s, **kw):
    return WorkerSpec(f"w{i}", s.url, s.kv_events, s.replay, "m", **kw)


def _fleet(tmp_path, n: int = 1, **router_kw):
    """A Router on a fresh SQLite store with `n` stand-ins (as `_sims` makes them) registered as w0, w1, ...;
    yields (router, sims)."""
    return routed_stand_ins(tmp_path, SimEngineConfig(model="m", num_blocks=64), n, **router_kw)


async def test_warm_cold_through_verbs_and_restart_from_store(store) -> None:
    sims = await _sims(2)
    r = await _router(store)
    try:
        for i, s in enumerate(sims):
            await r.register_worker(_spec(i, s))
        d = await r.route(TOKS, "m")
        assert d.verdict == "COLD"
        await _complete(sims[int(d.worker[1:])], TOKS, r)
        d = await r.route(TOKS, "m")
        assert (d.verdict, d.matched_tokens) == ("WARM", 96)
        w = await r.lifecycle(d.worker, "pause", mode="keep", clear_cache=False)       # preserving: index kept, not serving
        assert (w.phase, w.kv, w.warm_demoted, w.serving) == ("paused", "preserved", False, False)
        d2 = await r.route(TOKS, "m")
        assert d2.worker != d.worker and d2.verdict == "COLD"
        w = await r.lifecycle(d.worker, "resume")                    # warmth intact
        assert (w.kv, w.serving) == ("preserved", True) and (await r.route(TOKS, "m")).verdict == "WARM"
        e0 = r.worker(d.worker).ranks[0].epoch
        w = await r.lifecycle(d.worker, "reset_prefix_cache")
        assert (w.kv, w.serving, w.epoch) == ("forgotten", True, e0 + 2)  # bumped before and after the call
        assert json.loads(store.kv_get("epochs", f"{d.worker}/0"))["epoch"] == e0 + 2
        assert (await r.route(TOKS, "m")).verdict == "COLD"
        await _complete(sims[int(d.worker[1:])], TOKS, r)               # publishes [AllBlocksCleared, BlockStored]
        assert (await r.route(TOKS, "m")).verdict == "WARM"
        await r.stop()
        r = await _router(store)                                     # a new controller on the same store
        assert sorted(s.name for s in r.workers()) == ["w0", "w1"]
        d3 = await r.route(TOKS, "m")
        assert (d3.worker, d3.verdict, d3.matched_tokens) == (d.worker, "WARM", 96)  # rebuilt by replay
    finally:
        await r.stop()
        for s in sims:
            await s.stop()


@pytest.mark.parametrize("look_while_asleep", [True, False])
async def test_a_sleep_behind_the_back_of_a_pause_leaves_the_worker_cold(tmp_path, look_while_asleep) -> None:
    """The controller pauses a worker keeping its KV; behind its back the worker is slept at level 1 (its
    cache wiped) and woken. Whether a look saw it asleep (level 1) or only the /sleep count moving, its
    next route is COLD, and it is warm again once it holds the prefix anew."""
    async with _fleet(tmp_path, reconcile_interval_s=0.1 if look_while_asleep else 30.0) as (r, (sim,)):
        w0 = r._workers["w0"]
        await _complete(sim, TOKS, r)
        await w0.look()  # the baseline of the /sleep count
        assert (await r.route(TOKS, "m")).verdict == "WARM"
        await r.lifecycle("w0", "pause", mode="keep", clear_cache=False)
        async with aiohttp.ClientSession() as h:
            async with h.post(sim.url + "/sleep", params={"level": "1"}) as resp:
                assert resp.status == 200
            if look_while_asleep:
                await w0.look()
                assert [(s.phase, s.kv, s.serving) for s in r.workers()] == [("sleeping", "unknown", False)]
            async with h.post(sim.url + "/wake_up") as resp:
                assert resp.status == 200
        await w0.look()
        d = await r.route(TOKS, "m")
        assert (d.verdict, d.matched_tokens) == ("COLD", 0)  # was WARM 96 with an empty cache
        await _complete(sim, TOKS, r)
        assert (await _routed(r, TOKS, "WARM")).verdict == "WARM"  # (read, then proven: polled on a loaded machine)


@pytest.mark.parametrize("paused_by", ["controller", "behind"])
async def test_a_release_of_the_kv_cache_behind_the_controllers_back_leaves_the_worker_cold(tmp_path,
                                                                                            paused_by) -> None:
    """A paused worker (by the controller keeping its KV, or behind its back) has its KV cache released
    (/release_kv_cache_memory: the cache discarded, its AllBlocksCleared queued until the next step) and is woken,
    between two looks. The next route is COLD. NOTE: only the /sleep count was compared between looks, and a
    release shows as sleep level 0: the worker was routed WARM to an empty cache until its next step (review
    finding). The oracle is the stand-in's true cache."""
    async with _fleet(tmp_path, reconcile_interval_s=30.0) as (r, (sim,)):
        w0 = r._workers["w0"]
        await _complete(sim, TOKS, r)
        await w0.look()  # the baseline of the count
        assert (await r.route(TOKS, "m")).verdict == "WARM"
        async with aiohttp.ClientSession() as h:
            if paused_by == "controller":
                await r.lifecycle("w0", "pause", mode="keep", clear_cache=False)
            else:
                async with h.post(sim.url + "/pause", params={"mode": "keep", "clear_cache": "false"}) as resp:
                    assert resp.status == 200
            async with h.post(sim.url + "/release_kv_cache_memory") as resp:
                assert resp.status == 200, await resp.text()
            async with h.post(sim.url + "/wake_up") as resp:
                assert resp.status == 200
        assert not sim.engine.resident_external()  # the oracle: the cache is empty
        await w0.look()
        d = await r.route(TOKS, "m")
        assert (d.verdict, d.matched_tokens) == ("COLD", 0)  # was WARM with an empty cache
        await _complete(sim, TOKS, r)
        assert (await r.route(TOKS, "m")).verdict == "WARM"


async def test_a_restart_whose_first_batches_were_lost_is_warm_again(tmp_path) -> None:
    """The worker restarts (cache empty, seq from 0) and the controller misses its new publisher's first batches,
    so the first seq it sees is past the old publisher's last: no seq reset is seen, only the look's new start
    time (fence "reset"). The new publisher's batches are stamped after that start, so the fence lifts and
    what the worker stores next routes WARM; it stayed COLD for good before."""
    async with _fleet(tmp_path, reconcile_interval_s=30.0) as (r, (sim,)):
        w0 = r._workers["w0"]
        for k in range(4):
            await _complete(sim, [5000 + 200 * k + i for i in range(96)], r)
        await w0.look()
        async with aiohttp.ClientSession() as h:
            for path, params in (("/sim/restart", {}), ("/sim/drop_next_events", {"n": "6"})):
                async with h.post(sim.url + path, params=params) as resp:
                    assert resp.status == 200
        for k in range(10, 17):
            await _complete(sim, [5000 + 200 * k + i for i in range(96)])
        await asyncio.sleep(0.2)
        await w0.look()  # sees the new start time
        assert [s.fence for s in r.workers()] in (["reset"], [""])
        await _complete(sim, TOKS, r)
        d = await r.route(TOKS, "m")
        assert (d.verdict, d.matched_tokens) == ("WARM", 96)  # before: COLD 0, the fence up for good


async def test_a_restart_after_sleeps_keeps_its_fence_until_the_new_publisher(tmp_path) -> None:
    """The restarted process counts its /sleep calls from 0. NOTE: the look that saw the restart compared that
    with the old process's count, read it as a sleep between looks, and its invalidation dropped the restart's
    fence "reset", so a batch the old publisher left in the socket could still add blocks the new one lacks."""
    async with _fleet(tmp_path, reconcile_interval_s=30.0) as (r, (sim,)):
        w0 = r._workers["w0"]
        await _complete(sim, TOKS, r)
        await r.lifecycle("w0", "sleep", level=1)
        await r.lifecycle("w0", "wake_up")
        await w0.look()
        await w0.look()  # the baseline: one /sleep
        slept = r.metrics.epoch_bumps.labels("sleep_ops")._value.get()
        async with aiohttp.ClientSession() as h, h.post(sim.url + "/sim/restart") as resp:
            assert resp.status == 200
        await w0.look()
        print("after the restart's look:", [(s.fence, s.serving) for s in r.workers()])
        bumps = r.metrics.epoch_bumps
        assert bumps.labels("sleep_ops")._value.get() == slept  # before: +1, its invalidation dropping fence 'reset'
        assert bumps.labels("restart")._value.get() + bumps.labels("seq_reset")._value.get() >= 1  # control: seen


async def test_a_worker_unregistered_while_its_route_is_probed_is_not_chosen(tmp_path) -> None:
    async with _fleet(tmp_path, 2) as (r, sims):
        await _complete(sims[0], TOKS, r)
        w0 = r._workers["w0"]
        probe = w0.probe

        async def unregistered_meanwhile() -> bool:
            await r.unregister_worker("w0")  # an operator's call lands while the probe is out
            return await probe()

        w0.probe = unregistered_meanwhile  # type: ignore[method-assign]
        d = await r.route(TOKS, "m", probe=True)
        assert d.worker == "w1" and [w.name for w in r.workers()] == ["w1"]  # before: KeyError 'w0' (INTERNAL)


@pytest.mark.slow
async def test_sleep_partial_wake_reset_false_and_tenants(tmp_path) -> None:
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    (sim,) = await _sims(1)
    r = await _router(store)
    try:
        await r.register_worker(_spec(0, sim))
        await _complete(sim, TOKS, r, cache_salt="tenant-a")
        assert (await r.route(TOKS, "m", cache_salt="tenant-a")).verdict == "WARM"
        assert (await r.route(TOKS, "m", cache_salt="tenant-b")).verdict == "COLD"  # nothing leaks across tenants
        assert (await r.route(TOKS, "m")).verdict == "COLD"
        w = await r.lifecycle("w0", "sleep", level=1)
        assert (w.phase, w.kv, w.serving) == ("sleeping", "forgotten", False)
        with pytest.raises(Unavailable):
            await r.route(TOKS, "m")
        w = await r.lifecycle("w0", "wake_up", tags=["weights"])
        assert (w.phase, w.kv, w.serving) == ("sleeping", "unknown", False)  # partial wake: still asleep
        w = await r.lifecycle("w0", "wake_up")
        assert (w.phase, w.kv, w.serving) == ("serving", "unknown", True)
        assert (await r.route(TOKS, "m", cache_salt="tenant-a")).verdict == "COLD"
        # reset refused while a request is held: success:false -> unknown, still demoted
        await r.lifecycle("w0", "sleep", level=0)
        async with aiohttp.ClientSession() as h:
            held = asyncio.create_task(h.post(sim.url + "/v1/completions", json={"prompt": TOKS}))
            await wait_until(lambda: sim.engine.waiting, "the request to wait on the sleeping worker")
            w = await r.lifecycle("w0", "reset_prefix_cache")
            assert (w.kv, w.warm_demoted) == ("unknown", True)
            await r.lifecycle("w0", "wake_up")
            (await held).close()
        assert r.metrics.epoch_bumps.labels("reset_prefix_cache")._value.get() >= 1
    finally:
        await r.stop()
        await sim.stop()
        store.close()


async def test_bad_input_changes_nothing(tmp_path) -> None:
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    (sim,) = await _sims(1)
    r = await _router(store)
    try:
        for bad in (dict(url="ftp://x"), dict(url="http://h:1", kv_events="nope"), dict(name="../x"),
                    dict(hash_algo="xxhash"), dict(dp_ranks=0), dict(model="")):
            with pytest.raises(InvalidArgument):
                WorkerSpec(**{"name": "w", "url": "http://127.0.0.1:1", "kv_events": "tcp://127.0.0.1:2",
                              "replay": None, "model": "m", **bad})
        assert store.kv_scan("workers") == {}
        with pytest.raises(NotFound, match="no worker is registered"):  # not retried: nothing can serve it
            await r.route(TOKS, "m")
        await r.register_worker(_spec(0, sim))
        before = r.worker("w0").ranks[0]
        with pytest.raises(NotFound):
            await r.lifecycle("nope", "sleep", level=1)
        for verb, kw in (("nap", {}), ("sleep", {"level": 5}), ("pause", {"mode": "x"}), ("resume", {"tags": ["x"]})):
            with pytest.raises(InvalidArgument):
                await r.lifecycle("w0", verb, **kw)
        with pytest.raises(InvalidArgument):
            await r.route([1, -2], "m")
        with pytest.raises(InvalidArgument):
            await r.route("abc", "m")  # type: ignore[arg-type]
        assert r.worker("w0").ranks[0] == before
    finally:
        await r.stop()
        await sim.stop()
        store.close()


async def _junk_server(mode: str):
    async def junk(req: web.Request) -> web.Response:
        if mode == "500":
            return web.Response(status=500, text="boom")
        return web.Response(text="<html>not json</html>", content_type="text/html")
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", junk)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


async def _routed(r: Router, toks: list[int], verdict: str, timeout_s: float = 5.0) -> Any:
    """The route of `toks` once it is `verdict`, or the last one after `timeout_s`. NOTE: each frame was given 0.1 s
    to be read; on a loaded machine a malformed one was not read yet and the route was still WARM (a fresh-clone
    run)."""
    deadline = time.monotonic() + timeout_s
    while (d := await r.route(toks, "m")).verdict != verdict and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return d


async def test_junk_http_and_malformed_frames_fail_closed(tmp_path) -> None:
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    (sim,) = await _sims(1)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    runner, junk_url = await _junk_server("html")
    r = await _router(store)
    V = load()
    toks = V["token_ids"][:48]
    try:
        # a worker whose event stream we control, HTTP from the real stand-in
        await r.register_worker(WorkerSpec("ev", sim.url, f"tcp://127.0.0.1:{port}", None, "m", block_size=16))
        await r.register_worker(WorkerSpec("junk", junk_url, "tcp://127.0.0.1:1", None, "m", block_size=16))
        await asyncio.sleep(0.3)
        topic, _, payload = frames(V["vectors"][0])

        async def send(seq: int, body: bytes, parts: int = 3) -> None:
            pub.send_multipart([topic, seq.to_bytes(8, "big"), body][:parts])
            await asyncio.sleep(0.1)

        await send(0, payload)
        d = await _routed(r, toks, "WARM")
        assert (d.worker, d.verdict, d.matched_tokens) == ("ev", "WARM", 48)   # the vector re-proves residency
        seq = 1
        for bad in (b"\xc1junk", msgspec.msgpack.encode([1.0, [{"type": "BlockTeleported"}], 0]), None):
            if bad is None:
                await send(seq, payload, parts=2)          # a 2-frame message: malformed
            else:
                await send(seq, bad)
                seq += 1
            d = await _routed(r, toks, "COLD")
            assert d.verdict == "COLD", d                 # invalidated; the router stays up
            await send(seq, payload)                      # BlockStored of the new epoch re-proves residency
            seq += 1
            assert (await _routed(r, toks, "WARM")).verdict == "WARM"
        # an unrepaired gap (no replay endpoint) voids everything before it; the batch after it counts
        other = V["vectors"][2]  # stored_lora: different hashes (LoRA chain), parentless
        await send(seq + 1, frames(other)[2])
        assert (await _routed(r, toks, "COLD")).verdict == "COLD"
        assert r.metrics.kv_event_gaps._value.get() == 1
        assert r.metrics.kv_event_replays.labels("unrepaired")._value.get() == 1
        await send(0, payload)                            # seq back to 0: a publisher restart, then re-proof
        assert (await _routed(r, toks, "WARM")).verdict == "WARM" and r.worker("ev").ranks[0].seq == 0
        junk = [s for s in r.workers() if s.name == "junk"][0]
        assert not junk.serving and not junk.warm and junk.kv == "unknown"
        with pytest.raises(Unavailable):
            await r.lifecycle("junk", "sleep", level=1)                       # worker HTTP failure
        assert not [s for s in r.workers() if s.name == "junk"][0].serving
        assert r.metrics.kv_event_decode_errors._value.get() == 3
    finally:
        await r.stop()
        await runner.cleanup()
        pub.close(0)
        ctx.term()
        await sim.stop()
        store.close()


async def test_probe_closes_behind_the_back_window(tmp_path) -> None:
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    sims = await _sims(2)
    r = Router(store, Metrics(), RouterConfig(reconcile_interval_s=30.0))  # reconcile effectively off
    await r.start()
    try:
        for i, s in enumerate(sims):
            await r.register_worker(_spec(i, s))
        d = await r.route(TOKS, "m")
        await _complete(sims[int(d.worker[1:])], TOKS, r)
        assert (await r.route(TOKS, "m")).verdict == "WARM"
        async with aiohttp.ClientSession() as h:
            await h.post(sims[int(d.worker[1:])].url + "/sleep", params={"level": "1"})  # behind its back
        stale = await r.route(TOKS, "m")
        assert (stale.worker, stale.verdict) == (d.worker, "WARM")   # control: without a look, the window is open
        probed = await r.route(TOKS, "m", probe=True)
        assert probed.worker != d.worker and probed.verdict == "COLD"
        assert r.metrics.stale_route_guard.labels("probe")._value.get() == 1
    finally:
        await r.stop()
        for s in sims:
            await s.stop()
        store.close()


async def test_lora_routes_wrong_seed_never_warm_and_dp_rank_check(tmp_path) -> None:
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    sims = await _sims(2, loras={"sql": "/adapters/sql"})
    r = await _router(store)
    try:
        await r.register_worker(_spec(0, sims[0]))
        await r.register_worker(_spec(1, sims[1], hash_seed="42"))  # wrong PYTHONHASHSEED for that worker
        await _complete(sims[0], TOKS, r, model="sql")
        assert (await r.route(TOKS, "m", lora="sql")).verdict == "WARM"   # ("lora", name, root) on every block
        assert (await r.route(TOKS, "sql")).verdict == "WARM"             # the adapter name as model
        assert (await r.route(TOKS, "m")).verdict == "COLD"               # base model: other hashes
        with pytest.raises(NotFound, match=r"'other-model' \(registered models: m, sql \(LoRA of m\)\)"):
            await r.route(TOKS, "other-model")
        await _complete(sims[1], TOKS[:64], r)
        w1 = r.worker("w1")
        assert not w1.calibrated and r.index.num_blocks(("w1", 0)) == 0    # self-calibration failed: fail closed
        d = await r.route(TOKS[:64], "m")
        assert d.matched_tokens == 0 and d.verdict == "COLD"
        # control: the same request on the correctly configured worker is predicted warm
        await _complete(sims[0], TOKS[:64], r)
        assert (await r.route(TOKS[:64], "m")).verdict == "WARM"
        from controller.vllm.events import EventBatch
        e0 = r.worker("w0").ranks[0].epoch
        await r.worker("w0").on_batch(0, r.worker("w0").ranks[0].seq + 1, EventBatch(0.0, (), 1))
        assert r.worker("w0").ranks[0].epoch == e0 + 1 and (await r.route(TOKS[:64], "m")).verdict == "COLD"
    finally:
        await r.stop()
        for s in sims:
            await s.stop()
        store.close()


async def test_worker_restarted_while_controller_was_down(tmp_path) -> None:
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    (sim,) = await _sims(1)
    r = await _router(store)
    other = list(range(5000, 5064))
    try:
        await r.register_worker(_spec(0, sim))
        await _complete(sim, TOKS, r)
        await _complete(sim, other, r)
        assert (await r.route(TOKS, "m")).verdict == "WARM"
        await r.stop()
        sim.restart()                                   # seq back to 0, cache empty, new start time
        async with aiohttp.ClientSession() as h:
            async with h.post(sim.url + "/v1/completions", json={"prompt": other}) as resp:
                assert resp.status == 200
        r = await _router(store)
        restarts = r.metrics.epoch_bumps.labels("restart")
        await wait_until(lambda: restarts._value.get() >= 1, "the restart seen")
        assert (await r.route(TOKS, "m")).verdict == "COLD"                    # died with the old process
        assert (await _routed(r, other, "WARM")).verdict == "WARM"             # rebuilt from the new publisher
        assert restarts._value.get() == 1
    finally:
        await r.stop()
        await sim.stop()
        store.close()


async def test_dp_ranks_are_keyed_separately(tmp_path) -> None:
    import shutil
    import tempfile

    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    (sim,) = await _sims(1)
    d = tempfile.mkdtemp()
    ctx = zmq.Context()
    pubs = [ctx.socket(zmq.PUB) for _ in range(2)]
    pubs[0].bind(f"ipc://{d}/kv")
    pubs[1].bind(f"ipc://{d}/kv_dp1")   # vLLM's per-rank endpoint for ipc: suffix _dp<rank>
    r = await _router(store)
    V = load()
    by = {v["name"]: v for v in V["vectors"]}
    toks = V["token_ids"][:16]
    try:
        await r.register_worker(WorkerSpec("dp", sim.url, f"ipc://{d}/kv", None, "m", dp_ranks=2, block_size=16))
        await asyncio.sleep(0.3)
        assert sorted(s.dp_rank for s in r.workers()) == [0, 1]
        topic, seq_f, payload = frames(by["dp_rank1_default_topic"])  # data_parallel_rank = 1, seq 0
        pubs[1].send_multipart([topic, seq_f, payload])
        dec = await _routed(r, toks, "WARM")
        assert (dec.dp_rank, dec.verdict, dec.matched_tokens) == (1, "WARM", 16)
        pubs[0].send_multipart([topic, seq_f, payload])               # a rank-1 batch on rank 0's socket
        await wait_until(lambda: {s.dp_rank: s for s in r.workers()}[0].epoch == 1, "rank 0 to read the batch")
        st = {s.dp_rank: s for s in r.workers()}
        assert st[0].num_blocks == 0 and st[0].epoch == 1 and st[1].num_blocks == 1
    finally:
        await r.stop()
        for p in pubs:
            p.close(0)
        ctx.term()
        await sim.stop()
        store.close()
        shutil.rmtree(d, ignore_errors=True)


async def test_the_routers_store_calls_run_through_blocking(tmp_path) -> None:
    """Registration, restart and unregistration touch the store off the event loop, in order."""
    calls: list[str] = []

    async def blocking(fn, *args):  # type: ignore[no-untyped-def]
        calls.append(fn.__name__)
        return await asyncio.to_thread(fn, *args)

    sim = (await _sims(1))[0]
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    r = Router(store, Metrics(), RouterConfig(reconcile_interval_s=0.1), blocking=blocking)
    await r.start()
    try:
        await r.register_worker(_spec(0, sim, dp_ranks=1))
        assert calls == ["entries", "put", "next_epochs"]
        await r.stop()
        r = Router(store, Metrics(), RouterConfig(reconcile_interval_s=0.1), blocking=blocking)
        await r.start()
        assert calls[3:] == ["entries", "resumed_ranks"] and [w.name for w in r.workers()] == ["w0"]
        await r.unregister_worker("w0")
        assert calls[5:] == ["delete"] and store.kv_scan("workers") == {}
    finally:
        await r.stop()
        store.close()
        await sim.stop()
