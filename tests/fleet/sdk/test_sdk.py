"""The SDK: typed results, errors as fleet.core.errors with the server's message, retries on UNAVAILABLE only."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support.controller import make_tokens, start_controller, store_url

from fleet.app.redis_server import free_port
from fleet.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from fleet.sdk import NO_RETRY, AsyncFleetClient, BlobRef, FleetClient, RetryPolicy


@dataclasses.dataclass(frozen=True)
class CountingPolicy(RetryPolicy):
    """A RetryPolicy that records every backoff it computes (one per retry)."""

    log: list = dataclasses.field(default_factory=list)

    def backoff(self, attempt: int) -> float:
        d = RetryPolicy.backoff(self, attempt)
        self.log.append((attempt, d))
        return d


async def test_typed_results_and_errors(tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok)
    try:
        await asyncio.to_thread(_sync_typed, ctl.address, tok)
        async with AsyncFleetClient(ctl.address, token=tok.op) as ac:
            caller = await ac.whoami()
            assert caller.role == "operator" and (await ac.get_blob(await ac.put_blob(b"x" * 10))) == b"x" * 10
            fleet = await ac.fleet()
            assert fleet.leader and fleet.workers == ()
    finally:
        await ctl.stop(0)


def _sync_typed(address: str, tok) -> None:
    """Sync client in a thread (the server shares the test's event loop)."""
    policy = CountingPolicy()
    with FleetClient(address, token=tok.a, retry=policy) as c:
        ref = c.put_blob(b"tool result")
        assert isinstance(ref, BlobRef) and str(ref) == ref.ref and ref.size == 11
        with pytest.raises(dataclasses.FrozenInstanceError):
            ref.size = 3  # type: ignore[misc]
        assert c.get_blob(ref) == c.get_blob(ref.ref) == b"tool result"
        info = c.stat_blob(ref)
        assert (info.ref, info.size) == (ref.ref, 11) and info.created > 0
        assert c.whoami() == type(c.whoami())("acme", "tenant", "acme")
        with pytest.raises(NotFound) as nf:
            c.get_blob("ab" * 32)
        with pytest.raises(PermissionDenied, match="needs the operator or reader role"):
            c.workers()
        with pytest.raises(InvalidArgument, match="token ids"):
            c.route([-1], model="m")
    assert policy.log == []  # none of those errors was retried
    print("NotFound message from the server:", nf.value)
    with FleetClient(address, token="kvf_wrong") as c, pytest.raises(Unauthenticated, match="invalid bearer token"):
        c.whoami()


async def test_retries_until_the_server_comes_up(tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    port = free_port()
    policy = CountingPolicy(initial_backoff_s=0.1, deadline_s=30)
    result: dict[str, object] = {}

    def call() -> None:
        with FleetClient(f"127.0.0.1:{port}", token=tok.a, retry=policy) as c:
            result["first_try"] = time.monotonic()
            result["ref"] = c.put_blob(b"late server")

    t = threading.Thread(target=call)
    t.start()
    while not policy.log:  # the first attempt failed with UNAVAILABLE before any server existed
        await asyncio.sleep(0.02)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok, listen=f"127.0.0.1:{port}")
    try:
        await asyncio.to_thread(t.join, 30)
        print("retries before success:", len(policy.log), [round(d, 3) for _, d in policy.log])
        assert isinstance(result.get("ref"), BlobRef) and len(policy.log) >= 1
        assert [a for a, _ in policy.log] == list(range(len(policy.log)))
    finally:
        await ctl.stop(0)


async def test_gives_up_after_the_deadline() -> None:
    port = free_port()
    policy = CountingPolicy(initial_backoff_s=0.05, max_backoff_s=0.2, deadline_s=1.0, max_attempts=100)
    async with AsyncFleetClient(f"127.0.0.1:{port}", token="t", retry=policy) as c:
        with pytest.raises(Unavailable) as ei:
            await c.whoami()
    msg = str(ei.value)
    print(msg)
    m = re.search(r"unavailable after (\d+) attempt\(s\) over (\d+\.\d)s", msg)
    assert m and f"127.0.0.1:{port}" in msg and "kvfleet controller" in msg
    # backoffs 0.05, 0.1, 0.2, 0.2, ... (+-20%) inside a 1 s deadline: a handful of attempts, not a spin
    assert 3 <= int(m.group(1)) <= 12 and len(policy.log) >= int(m.group(1)) - 1
    assert float(m.group(2)) < 3.0  # gave up at its 1 s deadline (slack for a loaded machine), not after 30 s


async def test_retries_while_the_redis_store_is_down(redis_server, redis_url: str, tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(redis_url, tok)
    try:
        policy = CountingPolicy(initial_backoff_s=0.2, deadline_s=60)
        async with AsyncFleetClient(ctl.address, token=tok.a, retry=policy) as c:
            ref = await c.put_blob(b"survives a store outage")
            redis_server.kill()
            task = asyncio.create_task(c.get_blob(ref))
            while not policy.log:
                await asyncio.sleep(0.05)
            redis_server.start()
            got = await asyncio.wait_for(task, 60)
        print("retries during the outage:", len(policy.log))
        assert got == b"survives a store outage" and len(policy.log) >= 1
    finally:
        await ctl.stop(0)



async def _until(fn, pred, timeout: float = 10.0):
    """Poll an async call until pred(result) (KV events and reconcile are asynchronous)."""
    deadline = time.monotonic() + timeout
    while True:
        r = await fn()
        if pred(r) or time.monotonic() > deadline:
            return r
        await asyncio.sleep(0.05)


async def test_workers_route_lifecycle_through_the_sdk(tmp_path: Path) -> None:
    import aiohttp

    from fleet.app.testkit.sim_vllm.config import SimEngineConfig
    from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm

    sims = [await SimVllm(SimConfig(engine=SimEngineConfig(model="m", block_size=16, num_blocks=64))).start()
            for _ in range(2)]
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok, start_router=True)
    prompt = list(range(100, 164))  # 64 tokens = 4 blocks of 16
    try:
        async with AsyncFleetClient(ctl.address, token=tok.op) as op, \
                   AsyncFleetClient(ctl.address, token=tok.a) as a, \
                   AsyncFleetClient(ctl.address, token=tok.b) as b, aiohttp.ClientSession() as http:
            for i, s in enumerate(sims):
                info = await op.register_worker(f"w{i}", url=s.url, kv_events=s.kv_events, replay=s.replay, model="m")
                assert info.name == f"w{i}" and info.url == s.url and len(info.ranks) == 1
            listed = await _until(op.workers, lambda ws: all(w.serving for w in ws))
            assert sorted(w.name for w in listed) == ["w0", "w1"] and all(w.serving for w in listed)
            cold = await a.route(prompt, model="m")
            assert cold.verdict == "COLD" and cold.matched_tokens == 0
            assert cold.cache_salt == ctl.ctx.auth.cache_salt("acme")
            # the worker prefills the prompt with the tenant's salt; its BlockStored events make it WARM
            async with http.post(f"{cold.url}/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1,
                                                                     "cache_salt": cold.cache_salt}) as r:
                assert r.status == 200
            warm = await _until(lambda: a.route(prompt, model="m"), lambda d: d.verdict == "WARM")
            other = await b.route(prompt, model="m")
            print(f"tenant A: {warm.verdict} {warm.matched_tokens} tokens on {warm.worker} epoch {warm.epoch}; "
                  f"tenant B (other salt, control): {other.verdict} {other.matched_tokens}")
            assert warm.verdict == "WARM" and warm.worker == cold.worker and 0 < warm.matched_tokens <= 64
            assert other.verdict == "COLD" and other.matched_tokens == 0  # warmth is never shared across tenants
            # lifecycle through the controller: sleep forgets, the route never answers WARM for it
            w = await op.lifecycle(warm.worker, "sleep", level=1)
            print("sleep witness:", w)
            assert (w.phase, w.kv, w.warm_demoted, w.serving) == ("sleeping", "forgotten", True, False)
            assert w.epoch > warm.epoch and w.worker == warm.worker
            after = await a.route(prompt, model="m")
            assert after.worker != warm.worker and after.verdict == "COLD"
            woke = await op.lifecycle(warm.worker, "wake_up")
            assert (woke.phase, woke.kv, woke.serving) == ("serving", "unknown", True)
            again = await a.route(prompt, model="m")
            assert again.verdict == "COLD"  # nothing is warm until new events re-prove it
            fleet = await op.fleet()
            assert {x.name for x in fleet.workers} == {"w0", "w1"} and fleet.leader
            with pytest.raises(NotFound, match="no worker named 'w9'"):
                await op.lifecycle("w9", "sleep", level=1)
            with pytest.raises(InvalidArgument, match="worker url"):
                await op.register_worker("bad", url="not a url", kv_events="tcp://127.0.0.1:1", model="m")
            await op.unregister_worker("w1")
            assert [x.name for x in await op.workers()] == ["w0"]
    finally:
        await ctl.stop(0)
        for s in sims:
            await s.stop()


async def test_a_route_for_a_model_no_worker_serves_is_not_found_at_once(tmp_path: Path) -> None:
    # Found by review: route(model="m") with only sim-model registered was UNAVAILABLE, retried 8 times over 9 s,
    # and ended with "check that `kvfleet controller` is running". Before the fix this failed at the first raises:
    # Unavailable instead of NotFound.
    from fleet.app.testkit.sim_vllm.config import SimEngineConfig
    from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm

    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", block_size=16, num_blocks=64))).start()
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok, start_router=True)
    policy = CountingPolicy(initial_backoff_s=0.05, max_backoff_s=0.1, deadline_s=1.0)
    prompt = list(range(100, 164))
    try:
        async with AsyncFleetClient(ctl.address, token=tok.op) as op, \
                   AsyncFleetClient(ctl.address, token=tok.a, retry=policy) as a:
            await op.register_worker("w0", url=sim.url, kv_events=sim.kv_events, replay=sim.replay, model="m")
            await _until(op.workers, lambda ws: all(w.serving for w in ws))
            with pytest.raises(NotFound, match=r"no registered worker serves model 'typo' \(registered models: m\)"):
                await a.route(prompt, model="typo")
            with pytest.raises(NotFound, match="model 'm' with LoRA 'nope'"):
                await a.route(prompt, model="m", lora="nope")
            assert policy.log == []  # not retried
            assert (await a.route(prompt, model="m")).worker == "w0"  # control: the model it serves routes
            # control: registered but not serving stays UNAVAILABLE and is retried, and the controller answered
            # it, so the SDK does not send the user to check that the controller is running
            await op.lifecycle("w0", "sleep", level=1)
            with pytest.raises(Unavailable) as ei:
                await a.route(prompt, model="m")
    finally:
        await ctl.stop(0)
        await sim.stop()
    msg = str(ei.value)
    print(msg)
    assert len(policy.log) >= 1 and "asleep, paused or down" in msg
    assert "retry later; `kvfleet worker ls` shows each worker's phase" in msg  # what to do (it named no next step)
    assert f"the controller at {ctl.address} answered UNAVAILABLE" in msg and "kvfleet controller" not in msg


async def test_a_verb_the_worker_refuses_is_failed_precondition_and_sent_once(tmp_path: Path) -> None:
    """vLLM answers 400 to a /release_kv_cache_memory of a worker with no completed pause: asked again, it refuses
    again. NOTE: the controller answered UNAVAILABLE, and the SDK sent it 8 times over 9 s, each taking the worker out
    of routing and dropping its index (review finding). The control: a verb the worker takes (pause, then release)."""
    from fleet.app.testkit.sim_vllm.config import SimEngineConfig
    from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm

    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", block_size=16, num_blocks=64))).start()
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok, start_router=True)
    policy = CountingPolicy(initial_backoff_s=0.05, max_backoff_s=0.1, deadline_s=2.0)
    try:
        async with AsyncFleetClient(ctl.address, token=tok.op, retry=policy) as op:
            await op.register_worker("w0", url=sim.url, kv_events=sim.kv_events, replay=sim.replay, model="m")
            await _until(op.workers, lambda ws: all(w.serving for w in ws))
            with pytest.raises(FailedPrecondition, match="answered HTTP 400"):
                await op.lifecycle("w0", "release_kv_cache_memory")
            assert policy.log == []  # not retried
            await op.lifecycle("w0", "pause", clear_cache=False)
            w = await op.lifecycle("w0", "release_kv_cache_memory")  # control: taken after a pause
            assert (w.phase, w.kv) == ("paused", "forgotten")
    finally:
        await ctl.stop(0)
        await sim.stop()


def _errors_answered(ctl) -> float:
    """Every error status the controller has answered (kvfleet_rpc_errors_total, all labels)."""
    return sum(x.value for m in ctl.ctx.metrics.rpc_errors.collect() for x in m.samples if x.name.endswith("_total"))


async def test_bad_arguments_are_invalid_argument_before_any_rpc(tmp_path: Path) -> None:
    # Found by review: generate(s, -1) and working_set(s, budget_tokens=-5) raised protobuf's ValueError,
    # route("hello") a TypeError, and route([]) was sent (answered COLD by a fleet). Before the fix this failed at
    # its first call: ValueError "Value out of range: -1".
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok)
    bad = {
        "num_tokens must be >= 1, got -1": lambda c: c.generate("e1", -1),
        "num_tokens must be an integer, got float": lambda c: c.generate("e1", 2.0),
        "budget_tokens must be >= 0, got -5": lambda c: c.working_set("e1", budget_tokens=-5),
        "piece_id must be >= 0, got -1": lambda c: c.evict("e1", -1),
        "token_ids must be a list of token ids, not str": lambda c: c.route("hello", model="m"),
        "token_ids is empty": lambda c: c.route([], model="m"),
        r"token_ids must be a list of token ids: integers in \[0, 2\*\*32\)": lambda c: c.route([1, 2**32], model="m"),
        "append's token ids must be": lambda c: c.append("e1", [1, -2]),
        # found by review: array("I") took True as 1, so a mask appended ids 1 and 0 (the kernel refuses bools)
        "append's token ids must be integers, not bool": lambda c: c.append("e1", [True, False, 7]),
        "token_ids must be integers, not bool": lambda c: c.route((3, True), model="m"),
        "tags must be a list of strings, got str": lambda c: c.lifecycle("w0", "wake_up", tags="weights"),
        "dp_rank must be >= 0": lambda c: c.lifecycle("w0", "sleep", level=1, dp_rank=-1),
        "dp_ranks must be >= 1, got 0": lambda c: c.register_worker("w", url="http://h:1", kv_events="tcp://h:2",
                                                                     dp_ranks=0),
        r"put_blob takes bytes, got str; encode it first": lambda c: c.put_blob("text"),
    }
    try:
        async with AsyncFleetClient(ctl.address, token=tok.op, retry=NO_RETRY) as c:
            before = _errors_answered(ctl)
            for message, call in bad.items():
                with pytest.raises(InvalidArgument, match=message):
                    await call(c)
            assert _errors_answered(ctl) == before  # none of them reached the controller
            # control: good arguments reach it (no router on this controller: UNAVAILABLE)
            with pytest.raises(Unavailable):
                await c.route([1, 2], model="m")
            with pytest.raises(Unavailable):
                await c.lifecycle("w0", "sleep", level=1, dp_rank=0, tags=["weights"])
            assert _errors_answered(ctl) == before + 2
    finally:
        await ctl.stop(0)


async def test_a_lost_answer_to_an_unpin_is_not_retried(tmp_path: Path) -> None:
    # Pins are a counter: before, the SDK retried an UnpinBlob whose answer was lost after the controller applied
    # it, so one holder's unpin dropped two pins (the blob then collectable while the other still held it)
    from support.lossy_relay import LossyRelay

    ctl = await start_controller(store_url("sqlite", tmp_path), None)
    relay = LossyRelay(("127.0.0.1", int(ctl.address.rsplit(":", 1)[1])))
    direct = AsyncFleetClient(ctl.address)
    flaky = AsyncFleetClient(relay.address, retry=RetryPolicy(initial_backoff_s=0.05))
    try:
        ref = await direct.put_blob(b"held by two")
        await direct.pin_blob(ref)
        await direct.pin_blob(ref)
        await flaky.whoami()  # the connection is up
        relay.armed = True
        with pytest.raises(Unavailable):
            await flaky.unpin_blob(ref)  # applied; its answer lost
        assert relay.resets == 1
        assert (await direct.stat_blob(ref)).pins == 1  # before: 0
        assert (await flaky.stat_blob(ref)).pins == 1  # the control: a read is retried, and answers
    finally:
        await flaky.close()
        await direct.close()
        relay.close()
        await ctl.stop(0)


async def test_session_calls_take_the_clients_session_timeout() -> None:
    # before: every session call waited SESSION_TIMEOUT_S (120 s) per attempt, whatever the client set
    import socket

    from fleet.sdk.table import CREATE_SESSION

    silent = socket.socket()  # accepts connections, never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    c = AsyncFleetClient(f"127.0.0.1:{silent.getsockname()[1]}", session_timeout=0.5, retry=RetryPolicy(max_attempts=1))
    try:
        assert c._stub_method(CREATE_SESSION)[1] == 0.5
        with pytest.raises(Unavailable, match="deadline exceeded.*session_timeout"):  # after 0.5 s, not 120
            await c.create_session("s1", "You are terse.")
    finally:
        await c.close()
        silent.close()


async def test_a_malformed_session_answer_is_a_clear_error() -> None:
    # before: numpy's "buffer size must be a multiple of element size" and a JSONDecodeError left the SDK
    import grpc

    from fleet.api.kvfleet.v1 import sessions_pb2 as spb
    from fleet.api.kvfleet.v1 import sessions_pb2_grpc as spbg
    from fleet.core.errors import KvfleetError

    class Junk(spbg.SessionServiceServicer):
        async def Append(self, request: Any, context: Any) -> Any:
            return spb.AppendResponse(num_tokens=3, logits_f32=b"abc")

        async def AdmitToolResult(self, request: Any, context: Any) -> Any:
            r = spb.AdmitToolResultResponse(verdict="quarantined")
            r.witness.detail_json = "{not json"
            return r

    server = grpc.aio.server()
    spbg.add_SessionServiceServicer_to_server(Junk(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    c = AsyncFleetClient(f"127.0.0.1:{port}")
    try:
        with pytest.raises(KvfleetError, match="3 bytes of logits_f32"):
            await c.append("s1", "hi", return_logits=True)
        with pytest.raises(KvfleetError, match="detail_json that is not JSON"):
            await c.admit_tool_result("s1", "a" * 64)
    finally:
        await c.close()
        await server.stop(0)
