"""The controller server: health, reflection, bad input never crashes it, graceful stop, leader election, CLI."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support.controller import code_of, make_tokens, md, start_controller, store_url
from support.lossy_relay import SilentRelay

from controller.servicers import SERVICE_NAMES
from fleet.api.kvfleet.v1 import blobs_pb2, fleet_pb2, route_pb2, workers_pb2
from fleet.api.kvfleet.v1.blobs_pb2_grpc import BlobServiceStub
from fleet.api.kvfleet.v1.fleet_pb2_grpc import FleetServiceStub
from fleet.api.kvfleet.v1.route_pb2_grpc import RouteServiceStub
from fleet.api.kvfleet.v1.workers_pb2_grpc import WorkerServiceStub
from fleet.sdk import FleetClient

ROOT = Path(__file__).resolve().parents[2]
HS = health_pb2.HealthCheckResponse


async def _health(ch: grpc.aio.Channel, service: str = "") -> int:
    return (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status


async def test_health_and_reflection(tmp_path: Path) -> None:
    ctl = await start_controller(store_url("sqlite", tmp_path), make_tokens(tmp_path))
    try:
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            for name in ("", *SERVICE_NAMES):
                assert await _health(ch, name) == HS.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as ei:  # control: an unknown service is not SERVING
                await _health(ch, "kvfleet.v1.NoSuchService")
            assert ei.value.code() == grpc.StatusCode.NOT_FOUND
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            reqs = [reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvfleet.v1.RouteService")]
            answers = [r async for r in stub.ServerReflectionInfo(iter(reqs))]
            listed = {s.name for s in answers[0].list_services_response.service}
            print("reflection lists:", sorted(listed))
            assert set(SERVICE_NAMES) | {"grpc.health.v1.Health"} <= listed
            assert answers[1].file_descriptor_response.file_descriptor_proto  # the descriptor itself
    finally:
        await ctl.stop(0)


async def test_bad_input_gets_a_status_and_the_server_stays_up(tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok)
    try:
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            op, a = md(tok.op), md(tok.a)
            bad = {
                "route without model": RouteServiceStub(ch).Route(route_pb2.RouteRequest(token_ids=[1]), metadata=a),
                "lifecycle bad verb": WorkerServiceStub(ch).Lifecycle(workers_pb2.LifecycleRequest(name="w", verb="nap"), metadata=op),
                "stat bad ref": BlobServiceStub(ch).StatBlob(blobs_pb2.StatBlobRequest(ref="../../etc"), metadata=a),
                "register without name": WorkerServiceStub(ch).RegisterWorker(workers_pb2.RegisterWorkerRequest(), metadata=op),
            }
            for label, call in bad.items():
                code = await code_of(call)
                print(f"{label}: {code.name}")
                assert code == grpc.StatusCode.INVALID_ARGUMENT, label
            assert await _health(ch) == HS.SERVING
            assert (await FleetServiceStub(ch).WhoAmI(fleet_pb2.WhoAmIRequest(), metadata=a)).tenant == "acme"
        errors = ctl.ctx.metrics.registry.get_sample_value("kvfleet_rpc_errors_total", {"method": "Lifecycle", "code": "INVALID_ARGUMENT"})
        assert errors == 1.0
    finally:
        await ctl.stop(0)


async def test_graceful_stop_finishes_in_flight_calls(tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok)
    data = os.urandom(8 << 20)
    async with grpc.aio.insecure_channel(ctl.address) as ch:
        stub = BlobServiceStub(ch)

        async def slow_put():
            yield blobs_pb2.PutBlobRequest(header=blobs_pb2.PutBlobHeader(size=len(data)))
            for off in range(0, len(data), 1 << 20):
                await asyncio.sleep(0.05)
                yield blobs_pb2.PutBlobRequest(chunk=data[off:off + (1 << 20)])
        call = asyncio.ensure_future(stub.PutBlob(slow_put(), metadata=md(tok.a)))
        await asyncio.sleep(0.1)
        await ctl.stop(grace=10)
        r = await call
        assert r.size == len(data)
        code = await code_of(FleetServiceStub(ch).WhoAmI(fleet_pb2.WhoAmIRequest(), metadata=md(tok.a), timeout=2))
        assert code == grpc.StatusCode.UNAVAILABLE  # control: after the stop, nothing answers


async def test_leader_election_on_redis(redis_url: str, tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    kw = {"leader_election": True, "leader_ttl_s": 1.0, "start_router": True}
    first = await start_controller(redis_url, tok, **kw)
    second = await start_controller(redis_url, tok, **kw)
    try:
        for _ in range(100):
            if first.ctx.leader or second.ctx.leader:
                break
            await asyncio.sleep(0.05)
        leader, standby = (first, second) if first.ctx.leader else (second, first)
        await asyncio.sleep(0.5)
        assert leader.ctx.leader and not standby.ctx.leader
        assert leader.ctx.router is not None and standby.ctx.router is None  # only the leader routes
        async with grpc.aio.insecure_channel(standby.address) as ch:
            assert await _health(ch) == HS.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await FleetServiceStub(ch).WhoAmI(fleet_pb2.WhoAmIRequest(), metadata=md(tok.a))
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "standby" in ei.value.details()
            await leader.stop(0)
            for _ in range(400):
                if await _health(ch) == HS.SERVING:
                    break
                await asyncio.sleep(0.05)
            assert await _health(ch) == HS.SERVING and standby.ctx.leader and standby.ctx.router is not None
            assert (await FleetServiceStub(ch).WhoAmI(fleet_pb2.WhoAmIRequest(), metadata=md(tok.a))).tenant == "acme"
    finally:
        for c in (first, second):
            await c.stop(0)  # idempotent


@pytest.mark.parametrize("no_socket_timeout", [True, False], ids=["redis-py-5-client", "this-lock's-client"])
async def test_a_leader_cut_off_from_redis_steps_down_before_a_standby_can_lead(
        redis_url: str, redis_server: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        no_socket_timeout: bool) -> None:
    """The leader's path to Redis goes silent. NOTE: its renew then waited as long as the Redis client's socket
    timeout (none in redis-py 5's asyncio client, as here) while it kept serving, and the standby took the expired
    lock: two leaders (from 9 s to past 30 s at a 10 s ttl). Now the leader gives the lock up when its lease runs
    out by its own clock, before Redis lets anyone else take it."""
    import redis.asyncio as aredis

    if no_socket_timeout:  # redis-py 5's asyncio client, which pyproject allows: calls wait for ever
        real = aredis.Redis.from_url.__func__  # type: ignore[attr-defined]
        monkeypatch.setattr(aredis.Redis, "from_url", classmethod(
            lambda cls, url, **kw: real(cls, url, **{**kw, "socket_timeout": None})))
    relay = SilentRelay(("127.0.0.1", int(redis_url.rsplit(":", 1)[1].split("/")[0])))
    tok = make_tokens(tmp_path)
    kw = {"leader_election": True, "leader_ttl_s": 1.0, "gc_interval_s": 0}
    a = await start_controller(f"redis://127.0.0.1:{relay.port}/0", tok, **kw)
    b = None
    try:
        for _ in range(100):
            if a.ctx.leader:
                break
            await asyncio.sleep(0.05)
        b = await start_controller(redis_url, tok, **kw)
        await asyncio.sleep(0.5)
        assert a.ctx.leader and not b.ctx.leader
        relay.silent = True
        t0, both, a_down, b_up = asyncio.get_running_loop().time(), False, None, None
        while asyncio.get_running_loop().time() - t0 < 4.0 and b_up is None:
            await asyncio.sleep(0.02)
            both |= a.ctx.leader and b.ctx.leader
            now = asyncio.get_running_loop().time() - t0
            a_down = now if a_down is None and not a.ctx.leader else a_down
            b_up = now if b.ctx.leader else None
        print(f"silent at 0: the leader stepped down at {a_down} s, the standby led at {b_up} s; both at once: {both}")
        assert not both and a_down is not None and b_up is not None and a_down < b_up  # before: both from ~1 s on
        if not no_socket_timeout:  # with this lock's client: the standby goes, and the first one leads again
            await asyncio.wait_for(b.stop(0), 15)
            relay.silent = False
            for _ in range(200):
                if a.ctx.leader:
                    break
                await asyncio.sleep(0.05)
            assert a.ctx.leader  # NOTE: a Redis timeout in its lock request ended its leading task for good
    finally:
        relay.silent = False
        for c in (a, b):
            if c is not None:
                await asyncio.wait_for(c.stop(0), 15)
        relay.close()


def test_kvfleet_controller_cli(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    kv = [sys.executable, "-m", "fleet.app.cli.main", "controller"]
    op = subprocess.run([*kv, "--mint-token", "ops", "--role", "operator", "--tokens-file", str(tokens)],
                        env=env, capture_output=True, text=True, check=True).stdout.strip()
    proc = subprocess.Popen([*kv, "--listen", "127.0.0.1:0", "--metrics-port", "0", "--tokens-file", str(tokens),
                             "--store", f"sqlite:///{tmp_path / 'var' / 'kv.db'}"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(5):  # the start lines: the detector layers it runs, then where it listens
            line = proc.stdout.readline()
            print(line.strip())
            if m := re.search(r"listening on (\S+) .*metrics on [^\s:]*:(\d+)", line):
                break
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        with FleetClient(m.group(1), token=op) as c:
            assert c.whoami().role == "operator"
            c.put_blob(b"hello")
        text = urllib.request.urlopen(f"http://127.0.0.1:{m.group(2)}/metrics", timeout=5).read().decode()
        assert 'kvfleet_cas_ops_total{op="put",outcome="ok"} 1.0' in text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    bad = subprocess.run([*kv, "--listen", "nowhere"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "HOST:PORT" in bad.stderr


def test_env_is_read_at_the_edge_and_flags_win() -> None:
    from controller.main import config_from, parse_args

    env = {"KVFLEET_LISTEN": "0.0.0.0:6000", "KVFLEET_STORE": "redis://r:6379/0", "KVFLEET_SALT_SECRET": "00ff",
           "KVFLEET_RAY_ADDRESS": "ray://head:10001"}
    cfg = config_from(parse_args([], env), env)
    assert (cfg.listen, cfg.store_url, cfg.salt_secret, cfg.ray_address) == (
        "0.0.0.0:6000", "redis://r:6379/0", b"\x00\xff", "ray://head:10001")
    cfg = config_from(parse_args(["--listen", "127.0.0.1:7000"], env), env)
    assert cfg.listen == "127.0.0.1:7000"
    default = config_from(parse_args([], {}), {}).store_url
    assert default == "sqlite:///./var/kvfleet.db"  # the embedded default, relative to the working dir
    from fleet.cas.sqlite import sqlite_path

    assert sqlite_path(default) == "./var/kvfleet.db"            # never the system's /var
    assert sqlite_path("sqlite:////abs/kvfleet.db") == "/abs/kvfleet.db"


async def test_a_second_controller_on_an_address_in_use_refuses_to_start(tmp_path: Path) -> None:
    # before: gRPC's default SO_REUSEPORT let the second bind succeed, and the two controllers silently shared
    # the port's new connections (a blob stored through one was NotFound on 11 of 20 fresh connections)
    from fleet.core.errors import InvalidArgument

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = await start_controller(store_url("sqlite", tmp_path / "a"), None)
    try:
        with pytest.raises(InvalidArgument, match=f"cannot listen on {re.escape(first.address)}"):
            await start_controller(store_url("sqlite", tmp_path / "b"), None, listen=first.address)
        other = await start_controller(store_url("sqlite", tmp_path / "b"), None)  # control: a free port
        assert other.address != first.address
        await other.stop(0)
    finally:
        await first.stop(0)


def test_a_metrics_port_in_use_is_a_usage_error_naming_the_flag() -> None:
    # before: "[Errno 98] Address already in use", after the controller had started, with tracebacks at exit
    import socket

    from controller.main import _start_metrics
    from controller.metrics import Metrics
    from fleet.core.errors import InvalidArgument

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(InvalidArgument, match=f"cannot serve metrics on 127.0.0.1:{port}.*--metrics-port"):
            _start_metrics(Metrics(), port, "127.0.0.1")
    assert _start_metrics(Metrics(), -1, "127.0.0.1") is None  # the control: -1 serves none
